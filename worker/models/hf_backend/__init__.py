"""The transformers backend: any causal LM whose attention goes through transformers'
attention registry, run with batchgen's paged attention inside batchgen's engine."""

from batchgen.worker.models.hf_backend.hf_causal_lm import BackendConfig, HfCausalLM

__all__ = ["BackendConfig", "HfCausalLM"]
