"""Rotary tables, one per distinct rope of the model, with any scaling transformers computes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen.worker.models.model_config import ModelConfig, RopeSpec


@dataclass(slots=True)
class RopeTable:
    cos: torch.Tensor  # (max_positions, rotary_dim // 2) fp32, any attention scaling folded in
    sin: torch.Tensor


def inverse_frequencies(
    spec: RopeSpec, rotary_dim: int, hf_config: Any
) -> tuple[torch.Tensor, float]:
    """(rotary_dim // 2,) inverse frequencies and the cos/sin scaling, as transformers' forward has them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if spec.rope_type == "default":
        base = float(spec.get("rope_theta", 10000.0))
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base**exponents), 1.0
    # linear, llama3, yarn, dynamic and longrope at their initial (short-context)
    # frequencies: exact up to the context ``families`` cap the model at
    kwargs = {} if spec.layer_type is None else {"layer_type": spec.layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](hf_config, device=None, **kwargs)
    if inv_freq.shape[0] != rotary_dim // 2:
        raise ValueError(f"rope gave {inv_freq.shape[0]} frequencies for rotary_dim {rotary_dim}")
    return inv_freq.float(), float(scaling)


def rope_tables(config: ModelConfig, max_positions: int, device: torch.device) -> list[RopeTable]:
    """One table per entry of ``config.ropes``; layers name theirs by index."""
    rotary_dim = config.attention.rotary_dim
    tables = []
    for spec in config.ropes:
        inv_freq, scaling = inverse_frequencies(spec, rotary_dim, config.hf_config)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]  # (max_positions, rotary_dim // 2)
        tables.append(
            RopeTable((freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device))
        )
    return tables
