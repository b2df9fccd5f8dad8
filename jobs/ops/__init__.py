"""Job operations and the job lifecycle: submit, cancel, delete, download, finalize, retry, status."""
