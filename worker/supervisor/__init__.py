"""The worker supervisor: one engine process per GPU (or N on CPU) kept alive, the finalizer
process beside them, and their Prometheus metrics."""
