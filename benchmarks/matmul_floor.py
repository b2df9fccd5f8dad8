"""The matmul floor of a batchgen run: its steps' matrix multiplies and nothing else.

A step multiplies its tokens by each layer's four weight matrices (fused
q/k/v, o_proj, fused gate/up, down) and its sampled rows by the LM head.
Timed alone (the engine's own ``Linear`` projections: fp32 and bf16 ones
packed for oneDNN as the run left them, worker/models/weights.py), at every
(tokens, sampled rows) shape the run used, as often as it used it, they add
up to the least time the run could take; output tokens over that time is its
floor in tok/s, and the floor's time over the run's wall time is the share
of it the engine reached.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from batchgen.worker.models.layers.mlp import DenseMlp


def record_step_shapes(engine: Any) -> Counter[tuple[int, int]]:
    """Counts (tokens, sampled rows) of every step the engine runs from now on."""
    shapes: Counter[tuple[int, int]] = Counter()
    run = engine.runner.run

    def recording_run(plan: Any) -> Any:
        sampling, result = run(plan)
        shapes[(plan.num_tokens, len(sampling))] += 1
        return sampling, result

    engine.runner.run = recording_run
    return shapes


def _step_matmuls(weights: Any, x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor,
                  rows: torch.Tensor) -> None:  # fmt: skip
    for layer in weights.layers:  # DecoderLayer: SelfAttention and DenseMlp's Linear modules
        layer.attention.qkv(x)
        layer.attention.o(attn)
        layer.mlp.up(x)
        layer.mlp.down(act)
    weights.lm_head(rows)


def matmul_floor_s(model: Any, shapes: Counter[tuple[int, int]], repeats: int = 3) -> float | None:
    """Sum over the recorded shapes of (best of ``repeats`` timings) x (times used);
    ``model`` is the native ``Decoder`` (its ``weights``). None for a model whose
    MLPs are not all dense (MoE): its matmuls' shapes depend on the routing."""
    weights = model.weights
    if not all(isinstance(layer.mlp, DenseMlp) for layer in weights.layers):
        return None
    hidden = weights.embed.shape[1]
    q_size = weights.layers[0].attention.o.weight.shape[0]
    inter = weights.layers[0].mlp.down.weight.shape[0]
    dtype = weights.embed.dtype  # the activations' dtype: fp32, or bf16 in a bf16 engine
    total = 0.0
    for (tokens, rows), count in sorted(shapes.items()):
        x, attn, act = (
            torch.randn(tokens, hidden, dtype=dtype),
            torch.randn(tokens, q_size, dtype=dtype),
            torch.randn(tokens, inter, dtype=dtype),
        )
        sampled = x[:rows]
        _step_matmuls(weights, x, attn, act, sampled)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            _step_matmuls(weights, x, attn, act, sampled)
            best = min(best, time.perf_counter() - start)
        total += best * count
    return total
