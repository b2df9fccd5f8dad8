"""Rotary embedding tables, with any rope scaling transformers knows how to compute."""

from __future__ import annotations

import torch

from batchgen.worker.models.model_config import ModelConfig


def rope_tables(
    config: ModelConfig, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (max_positions, head_dim // 2) fp32, scaled like HF's forward."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = config.rope_parameters.get("rope_theta", 10000.0)
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        # llama3, linear, yarn, longrope...: the inverse frequencies and the
        # attention scaling exactly as transformers computes them.
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config, device=None)
    positions = torch.arange(max_positions, dtype=torch.float)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # (max_positions, head_dim // 2)
    return (freqs.cos() * scaling).to(device), (freqs.sin() * scaling).to(device)
