"""Writes a random-initialised checkpoint that transformers loads offline.

Weights use std 1.5/sqrt(hidden) instead of HF's 0.02: with the default init
and tied embeddings a random model greedily repeats one token forever, which
makes every parity check meaningless. Norm weights and biases are randomised
too, so an engine that ignores them cannot pass.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.toy.tokenizer import EOS_TOKEN, IM_END, train_tokenizer

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "mistral-v0.1")
# the window of the sliding-window archs: shorter than the contexts benchmarks and
# demos run, so it matters
TOY_WINDOW = 256


@dataclass(frozen=True, slots=True)
class ToySize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    # A real tokenizer's vocab may be smaller than the embedding table.
    tokenizer_vocab_size: int | None = None


SIZES: dict[str, ToySize] = {
    "tiny": ToySize(256, 4, 4, 2, 1024, 8192),  # ≈ 6.3M parameters
    "small": ToySize(768, 12, 12, 4, 2048, 32000),  # ≈ 100M parameters
}


def _config(arch: str, size: ToySize, dtype: str, eos_id: int):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        intermediate_size=size.intermediate_size,
        vocab_size=size.vocab_size,
        max_position_embeddings=size.max_position_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype=dtype,
    )
    if arch == "llama":
        # Llama-3 style frequency scaling, so the loader's rope scaling is exercised.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        }
        return LlamaConfig(
            **common, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=rope
        )
    if arch == "mistral":
        return MistralConfig(
            **common,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if arch == "qwen2":
        return Qwen2Config(
            **common,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "qwen3":
        return Qwen3Config(
            **common,
            head_dim=size.hidden_size // size.num_heads,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_bias=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if arch == "gemma2":
        # Gemma-2-shaped: local (window) and global layers alternate, both soft-caps,
        # (1 + w) norms before and after each block, scaled embeddings, GELU-tanh
        head_dim = size.hidden_size // size.num_heads
        return Gemma2Config(
            **common, head_dim=head_dim, query_pre_attn_scalar=head_dim,
            sliding_window=TOY_WINDOW, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, rms_norm_eps=1e-6,
            # untied: random tied embeddings scaled by sqrt(hidden) make greedy echo the
            # current token forever
            tie_word_embeddings=False,
            hidden_activation="gelu_pytorch_tanh",
        )  # fmt: skip
    if arch == "mistral-v0.1":
        # every layer slides, as Mistral 7B v0.1 (window 4096 of 32k positions)
        return MistralConfig(
            **common,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=TOY_WINDOW,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    raise ValueError(f"unknown toy architecture {arch!r}; choose one of {', '.join(ARCHS)}")


# 1-D weights of norms whose names do not end in "norm.weight" (GPT-2's ln_1,
# StableLM's per-head q_layernorm.norms.0): scales near 1 like the others
_OTHER_NORMS = re.compile(r"(^|\.)(ln_\w*|\w*layernorm\.norms\.\d+|\w*layer_norm)\.weight$")


def randomise(model, hidden_size: int, seed: int) -> None:
    """Fills every tensor from one seeded generator, in sorted-name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    std = 1.5 / math.sqrt(hidden_size)
    with torch.no_grad():
        for name, tensor in sorted(model.state_dict().items()):
            fresh = torch.empty(tensor.shape, dtype=torch.float32)
            if name.endswith("norm.weight") or _OTHER_NORMS.search(name):
                fresh.uniform_(0.5, 1.5, generator=gen)
            elif name.endswith(".bias"):
                fresh.normal_(0.0, 0.1, generator=gen)
            else:
                fresh.normal_(0.0, std, generator=gen)
            tensor.copy_(fresh.to(tensor.dtype))


def write_toy_checkpoint(
    out_dir: str | Path,
    arch: str = "llama",
    size: str | ToySize = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
) -> Path:
    """Writes config.json, model.safetensors (sharded if asked), generation_config.json
    and tokenizer files to ``out_dir``; returns the directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if arch not in ARCHS:
        raise ValueError(f"unknown toy architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if isinstance(size, str):
        if size not in SIZES:
            raise ValueError(f"unknown toy size {size!r}; choose one of {', '.join(SIZES)}")
        size = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    train_tokenizer(
        out,
        vocab_size=size.tokenizer_vocab_size or size.vocab_size,
        model_max_length=size.max_position_embeddings,
        seed=seed,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    im_end_id = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]

    config = _config(arch, size, dtype, eos_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    randomise(model, size.hidden_size, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id, do_sample=False
    )
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out), **kwargs)
    return out
