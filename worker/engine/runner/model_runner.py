"""Turns a scheduler plan into flat tensors, runs the model, samples.

The batch is laid out decodes first (one token each), then prefill chunks,
so attention can take the decode rows with one kernel and the rest with the
varlen prefill kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from batchgen.kernels.batch import AttentionBatch, HostBatch
from batchgen.worker.cpu_threads import ContentionWatch
from batchgen.worker.engine.constrained import TokenMasks
from batchgen.worker.engine.request import EngineRequest
from batchgen.worker.engine.runner.host_staging import stage
from batchgen.worker.engine.runner.pooling import EmbedSpan, Pooling, pool_step
from batchgen.worker.engine.runner.sampler import Sampler, SampleResult
from batchgen.worker.engine.scheduler import SchedulerPlan
from batchgen.worker.models import CausalLM


@dataclass(slots=True)
class HostStep:
    """A step's arrays on the host: what a tensor-parallel rank 0 sends the other ranks,
    from which each stages the same inputs (``ModelRunner.stage``)."""

    longs: list[np.ndarray]  # slot mapping, input ids, positions, logits rows (int64)
    ints: list[np.ndarray]  # decode tables, context lens; prefill tables, lens, starts (int32)
    num_decode_tokens: int
    decode_max_context_len: int
    prefill_max_query_len: int
    prefill_max_context_len: int


class StepPeers(Protocol):
    """The other ranks of a tensor-parallel group (``tensor_group.TensorGroup``)."""

    def send(self, host: HostStep) -> None: ...  # each step's arrays, before rank 0 runs it

    def lost(self, exc: BaseException) -> Exception: ...  # what a failed step raises

    def close(self) -> None: ...  # the other ranks exit


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    batch: AttentionBatch
    logits_indices: torch.Tensor  # (num_sampling,) rows whose logits we need
    sampling: list[EngineRequest]  # the requests those rows belong to
    embeds: list[EmbedSpan]  # embedding requests' rows; empty in a generation-only step
    host: HostStep


class DecodeGraphs(Protocol):
    """Decode-only steps replayed from captured graphs (``CudaGraphDecoder``)."""

    def can_run(self, num_decodes: int) -> bool: ...

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor: ...


def _block_table_array(requests: list[EngineRequest], num_blocks: int) -> np.ndarray:
    """(num_requests, num_blocks) int32; each row's tail repeats its own last
    block, so attention never reads another request's blocks."""
    table = np.empty((len(requests), max(num_blocks, 1)), dtype=np.int32)
    for row, req in zip(table, requests):
        n = len(req.block_table)
        row[:n] = req.block_table
        row[n:] = req.block_table[-1]
    return table


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sampler: Sampler,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
        pooling: Pooling | None = None,
        contention: ContentionWatch | None = None,
        peers: StepPeers | None = None,
    ) -> None:
        self.model = model
        self.peers = peers  # tensor parallel: the ranks that run each step with this one
        self.contention = contention  # CPU: fewer threads while others want the CPUs
        self.pooling = pooling or Pooling()
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = device
        self.graphs = graphs  # decode-only steps replay these when set
        self.num_graph_replays = 0
        # host arrays reach a CUDA device packed into pinned buffers (``stage``)
        self.packed = device.type == "cuda"
        self.masks = TokenMasks(model.config.vocab_size, pinned=self.packed)

    def prepare(self, plan: SchedulerPlan) -> StepInputs:
        bs = self.block_size
        decodes, prefills, lens = plan.decodes, plan.prefills, plan.prefill_lens
        nd = len(decodes)

        # decode rows: token at index num_computed, context num_computed + 1
        d_pos = np.fromiter((r.num_computed_tokens for r in decodes), np.int64, nd)
        d_ids = [r.token_ids[r.num_computed_tokens] for r in decodes]
        d_slot = (
            np.fromiter((r.block_table[r.num_computed_tokens // bs] for r in decodes), np.int64, nd)
            * bs
            + d_pos % bs
        )
        d_ctx = (d_pos + 1).astype(np.int32)
        d_max_ctx = int(d_ctx.max()) if nd else 0
        d_tables = _block_table_array(decodes, -(-d_max_ctx // bs))

        # prefill chunks: tokens [c, c + n) of each
        p_ids: list[int] = []
        p_pos_parts, p_slot_parts = [], []
        p_ctx = np.empty(len(prefills), dtype=np.int32)
        for i, (req, n) in enumerate(zip(prefills, lens)):
            c = req.num_computed_tokens
            p_ids.extend(req.token_ids[c : c + n])
            pos = np.arange(c, c + n, dtype=np.int64)
            table = np.asarray(req.block_table, dtype=np.int64)
            p_pos_parts.append(pos)
            p_slot_parts.append(table[pos // bs] * bs + pos % bs)
            p_ctx[i] = c + n
        p_qsl = np.zeros(len(prefills) + 1, dtype=np.int32)
        np.cumsum(lens, out=p_qsl[1:])
        p_max_ctx = int(p_ctx.max()) if prefills else 0
        p_tables = _block_table_array(prefills, -(-p_max_ctx // bs))

        positions = np.concatenate([d_pos, *p_pos_parts]) if p_pos_parts else d_pos
        slots = np.concatenate([d_slot, *p_slot_parts]) if p_slot_parts else d_slot

        # logits rows: every decode that reached its end, the last token of each finishing chunk
        sampling: list[EngineRequest] = []
        rows: list[int] = []
        for i, req in enumerate(decodes):
            if req.num_computed_tokens + 1 == req.num_tokens:
                sampling.append(req)
                rows.append(i)
        for i, (req, n) in enumerate(zip(prefills, lens)):
            if req.num_computed_tokens + n == req.num_tokens:
                sampling.append(req)
                rows.append(nd + int(p_qsl[i + 1]) - 1)
        embeds: list[EmbedSpan] = []
        if plan.embeds:  # a generation-only step never comes here
            embeds, sampling, rows = self._split_embeds(plan, p_qsl, sampling, rows)

        host = HostStep(
            longs=[slots, np.asarray(d_ids + p_ids, dtype=np.int64), positions,
                   np.asarray(rows, dtype=np.int64)],
            ints=[d_tables, d_ctx, p_tables, p_ctx, p_qsl],
            num_decode_tokens=nd,
            decode_max_context_len=d_max_ctx,
            prefill_max_query_len=max(lens, default=0),
            prefill_max_context_len=p_max_ctx,
        )  # fmt: skip
        ids_t, pos_t, batch, rows_t = self.stage(host)
        return StepInputs(
            input_ids=ids_t,
            positions=pos_t,
            batch=batch,
            logits_indices=rows_t,
            sampling=sampling,
            embeds=embeds,
            host=host,
        )

    def stage(
        self, host: HostStep
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        """The step's arrays on the device: input ids, positions, the attention batch and
        the rows whose logits are needed."""
        positions = host.longs[2]
        d_tables, _, p_tables, _, p_qsl = host.ints
        # on CUDA: one pinned buffer and one queued copy per dtype
        slot_t, ids_t, pos_t, rows_t = stage(host.longs, torch.int64, self.device, self.packed)
        d_tables_t, d_ctx_t, p_tables_t, p_ctx_t, p_qsl_t = stage(
            host.ints, torch.int32, self.device, self.packed
        )
        batch = AttentionBatch(
            slot_mapping=slot_t,
            num_decode_tokens=host.num_decode_tokens,
            decode_block_tables=d_tables_t,
            decode_context_lens=d_ctx_t,
            decode_max_context_len=host.decode_max_context_len,
            prefill_block_tables=p_tables_t,
            prefill_context_lens=p_ctx_t,
            prefill_query_start_loc=p_qsl_t,
            prefill_max_query_len=host.prefill_max_query_len,
            prefill_max_context_len=host.prefill_max_context_len,
            host=HostBatch(positions, d_tables, p_tables, p_qsl),
        )
        return ids_t, pos_t, batch, rows_t

    @staticmethod
    def _split_embeds(
        plan: SchedulerPlan, p_qsl: np.ndarray, sampling: list[EngineRequest], rows: list[int]
    ) -> tuple[list[EmbedSpan], list[EngineRequest], list[int]]:
        """The embedding requests' row spans; they leave the sampling rows."""
        nd = len(plan.decodes)
        spans = [
            EmbedSpan(r, i, r.num_computed_tokens, 1)
            for i, r in enumerate(plan.decodes) if r.embed is not None
        ]  # fmt: skip
        spans += [
            EmbedSpan(r, nd + int(p_qsl[i]), r.num_computed_tokens, n)
            for i, (r, n) in enumerate(zip(plan.prefills, plan.prefill_lens))
            if r.embed is not None
        ]
        kept = [(r, row) for r, row in zip(sampling, rows) if r.embed is None]
        return spans, [r for r, _ in kept], [row for _, row in kept]

    def run(self, plan: SchedulerPlan) -> tuple[list[EngineRequest], SampleResult]:
        """Runs one step; returns the requests that get a token and what they got.
        Embedding requests get none: their rows are pooled (``pool_step``)."""
        if self.contention is not None:
            self.contention.check()
        if self.peers is None:
            return self._run(plan)
        try:  # a step that failed on any rank leaves the group out of step: it is lost
            return self._run(plan)
        except Exception as exc:
            raise self.peers.lost(exc) from exc

    def _run(self, plan: SchedulerPlan) -> tuple[list[EngineRequest], SampleResult]:
        inputs = self.prepare(plan)
        if self.peers is not None:
            self.peers.send(inputs.host)
        pending = self.masks.start(inputs.sampling)  # filled while the model runs
        if self.graphs is not None and not plan.prefills and self.graphs.can_run(len(plan.decodes)):
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, inputs.batch)
            self.num_graph_replays += 1
        else:
            hidden = self.model.forward(
                inputs.input_ids, inputs.positions, inputs.batch, self.kv_caches
            )
        if inputs.embeds:
            pool_step(self.pooling, hidden, inputs.embeds)
        if not inputs.sampling:
            return [], SampleResult([], [])
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        masks = self.masks.wait(pending, logits.device) if pending is not None else None
        return inputs.sampling, self.sampler(logits, inputs.sampling, masks)
