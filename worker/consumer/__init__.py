"""The consumer side of a model's request stream, which the worker's queue loop uses: read, sink, commit."""
