"""Continuous batching policy: who runs this step, with how many tokens.

Each step: running requests first (oldest / most important first), one token
each for decodes and a chunk for unfinished prefills, then admission of
waiting requests while the token budget, max_num_seqs and free blocks allow.
When blocks run out a victim is preempted by recompute (its blocks freed, its
computed count reset; the prefix cache often gives most of them back).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from batchgen.worker.engine.block_manager import BlockManager
from batchgen.worker.engine.kv_window import SlidingRelease
from batchgen.worker.engine.request import EngineRequest, RequestStatus


def pick_victim(candidates: list[EngineRequest]) -> EngineRequest:
    """The least important, most recently arrived request.

    The oldest request of the highest priority is never chosen while others
    run, so it always makes progress and finishes; by induction no request is
    preempted without bound, however long its output.
    """
    return max(candidates, key=lambda r: (r.priority, r.arrival_order))


@dataclass(slots=True)
class SchedulerPlan:
    """What one step computes. ``decodes`` get exactly one token each and come
    first in the batch; ``prefills`` get ``prefill_lens[i]`` tokens each."""

    decodes: list[EngineRequest] = field(default_factory=list)
    prefills: list[EngineRequest] = field(default_factory=list)
    prefill_lens: list[int] = field(default_factory=list)
    preempted: list[EngineRequest] = field(default_factory=list)
    first_admitted: list[EngineRequest] = field(default_factory=list)  # for prefix-hit stats
    embeds: list[EngineRequest] = field(default_factory=list)  # embedding requests among them

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(self.prefill_lens)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark_blocks: int = 0,
        embeds_read_prefix_cache: bool = True,
        sliding_release: SlidingRelease | None = None,
    ) -> None:
        self.blocks = block_manager
        # when every layer slides: hands back blocks that left every window
        self.sliding_release = sliding_release
        # False when the pooling needs every prompt position's hidden state
        self.embeds_read_prefix_cache = embeds_read_prefix_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # free blocks kept back from admission so running requests can grow
        self.watermark_blocks = watermark_blocks
        self.waiting: list[
            tuple[int, int, EngineRequest]
        ] = []  # heap; finished ones skipped lazily
        self.num_waiting = 0
        self.running: list[EngineRequest] = []  # sorted by (priority, arrival_order)
        self.num_preemptions = 0

    def add(self, request: EngineRequest) -> None:
        request.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (request.priority, request.arrival_order, request))
        self.num_waiting += 1

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    # -- one step -------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        plan = SchedulerPlan()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._grow(req, num_new, plan, scheduled):
                break  # req itself was the victim; everything after it is less important
            scheduled.add(id(req))
            budget -= num_new
            self._add_to_plan(plan, req, num_new)
            i += 1
        if not plan.preempted:
            self._admit(plan, budget)
        # longest context first: attention can then take similar lengths together
        plan.decodes.sort(key=lambda r: r.num_computed_tokens, reverse=True)
        return plan

    def _grow(
        self, req: EngineRequest, num_new: int, plan: SchedulerPlan, scheduled: set[int]
    ) -> bool:
        """Makes room for num_new more tokens of req, preempting others if needed."""
        need = self.blocks.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_table)
        while not self.blocks.can_allocate(need):
            candidates = [r for r in self.running if id(r) not in scheduled]
            victim = pick_victim(candidates)
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return False
        if need > 0:
            req.block_table.extend(self.blocks.allocate(need))
        return True

    def _admit(self, plan: SchedulerPlan, budget: int) -> None:
        bs = self.blocks.block_size
        # first blocks that requests admitted in this step compute from scratch
        heads_being_computed: set[tuple[int, ...]] = set()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            _, _, req = self.waiting[0]
            if req.is_finished:  # aborted while waiting
                heapq.heappop(self.waiting)
                continue
            reads_cache = req.embed is None or self.embeds_read_prefix_cache
            hits = self.blocks.find_cached_prefix(req.token_ids) if reads_cache else []
            head = tuple(req.token_ids[:bs]) if req.num_tokens > bs else None
            if not hits and head is not None and self.blocks.enable_prefix_caching and reads_cache:
                if head in heads_being_computed:
                    # its prefix is being computed in this very step: admitted one
                    # step later, it reads those blocks from the cache instead
                    break
                heads_being_computed.add(head)
            num_computed = len(hits) * self.blocks.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            need = self.blocks.blocks_needed(num_computed + num_new) - len(hits)
            newly_taken = sum(1 for b in hits if self.blocks.blocks[b].ref_count == 0)
            reserve = self.watermark_blocks if self.running else 0
            if not self.blocks.can_allocate(need + newly_taken, reserve=reserve):
                break
            heapq.heappop(self.waiting)
            self.num_waiting -= 1
            self.blocks.take_cached(hits)
            req.block_table = hits + self.blocks.allocate(need)
            req.num_computed_tokens = num_computed
            req.num_hashed_blocks = len(hits)
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = num_computed
                plan.first_admitted.append(req)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: (r.priority, r.arrival_order))
            budget -= num_new
            self._add_to_plan(plan, req, num_new)

    @staticmethod
    def _add_to_plan(plan: SchedulerPlan, req: EngineRequest, num_new: int) -> None:
        if req.embed is not None:
            plan.embeds.append(req)
        if num_new == 1:
            plan.decodes.append(req)
        else:
            plan.prefills.append(req)
            plan.prefill_lens.append(num_new)

    def _drop_blocks(self, req: EngineRequest) -> None:
        """Hands back every block the request still holds."""
        self.blocks.release(req.block_table[req.num_released_blocks :])
        req.block_table = []
        req.num_released_blocks = 0

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self._drop_blocks(req)
        req.num_computed_tokens = 0
        req.num_hashed_blocks = 0
        if req.embed is not None:
            req.embed.state = None  # recomputed from the start
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)

    # -- after the model ran ------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled: list[int]) -> list[EngineRequest]:
        """Advances computed counts, caches full blocks, appends sampled tokens.

        ``sampled`` holds one token for each request of plan.decodes +
        plan.prefills that reached the end of its tokens, in that order
        (embedding requests never get one). Returns those requests.
        """
        grown = []
        tokens = iter(sampled)
        lens = [1] * len(plan.decodes) + plan.prefill_lens
        for req, num_new in zip(plan.decodes + plan.prefills, lens):
            req.num_computed_tokens += num_new
            req.num_hashed_blocks = self.blocks.cache_full_blocks(
                req.block_table, req.token_ids, req.num_computed_tokens, req.num_hashed_blocks
            )
            if self.sliding_release is not None:
                self._release_slid_out(req)
            if req.num_computed_tokens == req.num_tokens and req.embed is None:
                req.token_ids.append(next(tokens))
                grown.append(req)
        return grown

    def _release_slid_out(self, req: EngineRequest) -> None:
        assert self.sliding_release is not None
        gone = self.sliding_release.releasable(req.num_computed_tokens, req.num_hashed_blocks)
        if gone > req.num_released_blocks:
            self.blocks.release(req.block_table[req.num_released_blocks : gone])
            req.num_released_blocks = gone

    def finish(self, req: EngineRequest) -> None:
        """Takes a request out (finished or aborted) and frees its blocks."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self._drop_blocks(req)
        elif req.status is RequestStatus.WAITING:
            self.num_waiting -= 1  # its heap entry is skipped when it surfaces
        req.status = RequestStatus.FINISHED
