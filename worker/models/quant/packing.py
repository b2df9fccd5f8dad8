"""Integers packed into int32 words, low bits first, as every int4/int8 format here stores them."""

from __future__ import annotations

import torch


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-wide fields of int32 ``words`` along ``dim``: word w's field j
    (bits [j * bits, (j + 1) * bits)) becomes element w * (32 // bits) + j of that dim."""
    per_word = 32 // bits
    dim = dim % words.dim()
    shape = [1] * (words.dim() + 1)
    shape[dim + 1] = per_word
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device).view(shape)
    fields = (words.unsqueeze(dim + 1) >> shifts) & ((1 << bits) - 1)
    return fields.flatten(dim, dim + 1)
