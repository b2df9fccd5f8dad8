"""batchgen: batch LLM inference over Redis streams, paged KV cache and Parquet sinks."""

__version__ = "0.1.0"
