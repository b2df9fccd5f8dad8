"""Where rows and files live: a job's output directory (local or object store) and the result cache."""
