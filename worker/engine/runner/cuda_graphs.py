"""Decode steps replayed as CUDA graphs.

A decode step of a small model is a few hundred tiny kernel launches; on a
GPU the launches, not the math, set its time. We capture the model's forward
once per padded batch size (decode-only batches: one token per sequence) into
static input buffers and replay it. Padding rows have context length 0 and
the padding slot id, so they store nothing and attend to nothing.
"""

from __future__ import annotations

import torch

from batchgen.kernels.batch import AttentionBatch
from batchgen.kernels.reference import PAD_SLOT_ID
from batchgen.worker.models import CausalLM


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted({*sizes, max_batch})


class CudaGraphDecoder:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        # static inputs every graph reads; each replay copies a step's values in
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((self.max_batch,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.tables = torch.zeros(self.max_batch, max_blocks, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self._no_prefill = torch.zeros(0, max_blocks, dtype=torch.int32, device=device)
        self._no_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self._start_loc = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _batch(self, size: int) -> AttentionBatch:
        return AttentionBatch(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.context_lens[:size],
            # a bound, not the exact max: the kernel reads each row's own length
            decode_max_context_len=self.max_model_len,
            prefill_block_tables=self._no_prefill,
            prefill_context_lens=self._no_lens,
            prefill_query_start_loc=self._start_loc,
            prefill_max_query_len=0,
            prefill_max_context_len=0,
        )

    def _forward(self, size: int) -> torch.Tensor:
        return self.model.forward(
            self.input_ids[:size], self.positions[:size], self._batch(size), self.kv_caches
        )

    def capture(self) -> None:
        """Captures every size, largest first, all sharing one memory pool."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the Triton kernels before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def can_run(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_batch

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """Replays the smallest graph that holds this decode-only batch."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        width = batch.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(batch.slot_mapping)
        self.tables[:n, :width].copy_(batch.decode_block_tables)
        self.context_lens[:n].copy_(batch.decode_context_lens)
        # padding rows: store nothing (pad slot), attend to nothing (length 0)
        self.slots[n:size].fill_(PAD_SLOT_ID)
        self.context_lens[n:size].zero_()
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]
