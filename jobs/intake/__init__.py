"""Reading and validating input: JSONL lines and tables become queue entries, or errors naming line and column."""
