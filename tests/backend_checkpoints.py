"""Tiny random checkpoints of architectures only the transformers backend runs, built offline.

Each is a transformers config object with tiny sizes and the architecture's
switches turned on (partial rotary, parallel residuals, biases, qk norms,
logit scales, per-layer attention scales), the toy tokenizer's vocabulary,
and weights randomised like the toy models (``batchgen.toy.checkpoint``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 512
MAX_POSITIONS = 512
_SIZE: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)


def _config(arch: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS)

    def partial(factor: float) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}

    if arch == "gpt_neox":  # partial rotary, parallel residual, LayerNorm with bias
        return tf.GPTNeoXConfig(**_SIZE, **common, rope_parameters=partial(0.5),
                                use_parallel_residual=True,
                                tie_word_embeddings=False)  # fmt: skip
    if arch == "gpt2":  # learned positions, Conv1D, a different attention scale per layer
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS,
                             vocab_size=VOCAB, scale_attn_by_inverse_layer_idx=True, bos_token_id=None,
                             eos_token_id=None)  # fmt: skip
    if arch == "phi":  # partial rotary, q/k LayerNorm, parallel block, lm_head bias
        return tf.PhiConfig(**_SIZE, **common, rope_parameters=partial(0.5), qk_layernorm=True)
    if arch == "cohere":  # parallel block, LayerNorm without bias, logit scale, q/k norm
        return tf.CohereConfig(**_SIZE, **common, num_key_value_heads=2, logit_scale=0.5,
                               use_qk_norm=True)  # fmt: skip
    if arch == "starcoder2":  # GQA, biases everywhere, GELU MLP
        return tf.Starcoder2Config(**_SIZE, **common, num_key_value_heads=2, sliding_window=None)
    if arch == "stablelm":  # partial rotary, qkv bias, per-head q/k LayerNorm
        return tf.StableLmConfig(**_SIZE, **common, num_key_value_heads=2, rope_parameters=partial(0.25),
                                 use_qkv_bias=True, qk_layernorm=True)  # fmt: skip
    raise ValueError(f"no backend test config for {arch!r}")


BACKEND_ARCHS = ("gpt_neox", "gpt2", "phi", "cohere", "starcoder2", "stablelm")


def write_checkpoint(out: Path, config: Any, seed: int = 0) -> Path:
    """config.json, model.safetensors, generation_config.json and the toy tokenizer in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from batchgen.toy.checkpoint import randomise
    from batchgen.toy.tokenizer import EOS_TOKEN, train_tokenizer

    hf_logging.disable_progress_bar()
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, vocab_size=config.vocab_size, model_max_length=MAX_POSITIONS, seed=seed)
    eos = int(AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    config.eos_token_id = config.pad_token_id = eos
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, config.hidden_size, seed)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, do_sample=False)
    model.save_pretrained(str(out))
    return out


def write_backend_checkpoint(out: Path, arch: str, seed: int = 0) -> Path:
    return write_checkpoint(out, _config(arch), seed)
