"""Compiling every tile choice of the Triton prefill kernel at load.

The prefill kernel's tiles follow the step's longest chunk (``prefill_tiles``),
and each choice is a compile of its own (seconds on a GPU). Left to the steps,
the first steps, or a timed run, compile whichever tiles their chunk lengths
pick. Here each choice the engine's limits allow is launched once at load, on
a chunk whose K/V are stored nowhere (padding slots) and whose output is
dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from batchgen.kernels.batch import AttentionBatch, HostBatch
from batchgen.kernels.reference import PAD_SLOT_ID
from batchgen.worker.models import CausalLM


def prefill_warmup_lengths(
    max_query_len: int, group: int, head_dim: int
) -> dict[tuple[int, int], int]:
    """Each (block_m, tile_size) that chunks of 1 to ``max_query_len`` tokens pick,
    with the shortest chunk length that picks it."""
    # here, not at the top: importing the kernels imports triton and defines them
    # (compiled or interpreted, as TRITON_INTERPRET says then); see ``select_ops``
    from batchgen.kernels.triton.prefill_attention import prefill_tiles

    lengths: dict[tuple[int, int], int] = {}
    for q in range(1, max_query_len + 1):
        lengths.setdefault(prefill_tiles(q, group, head_dim), q)
    return lengths


def warm_up_prefill(
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    max_query_len: int,
    group: int,
    head_dim: int,
) -> list[int]:
    """Runs one forward per prefill tile choice (``prefill_warmup_lengths``); returns the
    chunk lengths it ran. Nothing is stored: every token's slot is the padding slot."""
    device = kv_caches[0][0].device
    lengths = list(prefill_warmup_lengths(max_query_len, group, head_dim).values())
    for q in lengths:
        table = np.zeros((1, -(-q // block_size)), dtype=np.int32)  # reads block 0's zeros
        bounds = np.array([0, q], dtype=np.int32)
        positions = np.arange(q, dtype=np.int64)
        batch = AttentionBatch(
            slot_mapping=torch.full((q,), PAD_SLOT_ID, dtype=torch.int64, device=device),
            num_decode_tokens=0,
            decode_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
            decode_max_context_len=0,
            prefill_block_tables=torch.from_numpy(table).to(device),
            prefill_context_lens=torch.full((1,), q, dtype=torch.int32, device=device),
            prefill_query_start_loc=torch.from_numpy(bounds).to(device),
            prefill_max_query_len=q,
            prefill_max_context_len=q,
            host=HostBatch(positions, np.zeros((0, 1), dtype=np.int32), table, bounds),
        )
        input_ids = torch.zeros(q, dtype=torch.int64, device=device)
        model.forward(input_ids, torch.from_numpy(positions).to(device), batch, kv_caches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return lengths
