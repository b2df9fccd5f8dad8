"""Hybrid models' linear-attention layers (gated DeltaNet): a recurrent state per sequence.

Qwen3-Next and Qwen3.5 put gated DeltaNet layers between full-attention ones.
A DeltaNet layer reads no KV cache: it carries, per sequence, a causal-conv
window and a recurrent matrix from one token to the next, in a transformers
``Cache`` object whose batch rows are sequences. batchgen's step is one flat
row of many sequences' tokens, so each such module's forward is wrapped: the
step's tokens are cut into their sequences and each runs through transformers'
own module with that sequence's cache object, which lives from step to step.

A sequence is known by the first block of its KV block table (every hybrid
has full-attention layers, so every sequence holds blocks, and with prefix
caching off, which these models need, no two running sequences share one). A
sequence that starts at position 0 starts from a fresh state: that is how a
preempted sequence (recomputed from its tokens), one handed back to the queue
and resumed elsewhere, and a new one on a reused block all begin. A finished
sequence's state is dropped when its first block shows up in another
sequence's table; until then it costs memory, at most one state per KV block.
Prefix caching stays off: a cached prefix would skip the tokens the state is
made of (keeping it would take a state snapshot per cached block).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.kernels.batch import AttentionBatch
from batchgen.worker.worker_errors import UnsupportedModelError

# the transformers modules whose state this file keeps (their forward takes
# hidden_states, cache, attention_mask, and reads and writes the cache's
# conv and recurrent states at their layer_idx; before 5.24 the cache argument
# was cache_params, and passed as ``cache`` it vanished into **kwargs: every
# chunk started from a zero state, silently)
STATEFUL_MIXERS = ("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's tokens in the step's flat batch, with its state."""

    start: int
    end: int
    cache: Any  # its transformers Cache object


# the segments of the forward in progress; None outside a step (the load-time probe)
SEGMENTS: ContextVar[list[Segment] | None] = ContextVar("batchgen_segments", default=None)


class SequenceStates:
    """Each running sequence's transformers cache object, keyed by its first KV block."""

    def __init__(self, hf_config: Any) -> None:
        self.hf_config = hf_config
        self.caches: dict[int, Any] = {}

    def segments(self, batch: AttentionBatch) -> list[Segment]:
        """The step's sequences in batch order: decode rows (one token each), then prefill
        chunks; read from the batch's host arrays (the device's would make every forward
        wait for the device)."""
        from transformers import DynamicCache

        host = batch.host
        if host is None:
            raise RuntimeError("a model with a state per sequence needs the batch's host arrays")
        nd = batch.num_decode_tokens
        starts = list(range(nd)) + [nd + s for s in host.prefill_query_start_loc.tolist()]
        tables = host.decode_block_tables.tolist() + host.prefill_block_tables.tolist()
        pos = host.positions.tolist()
        segments = []
        for (start, end), table in zip(itertools.pairwise(starts), tables):
            if pos[start] == 0:
                self.caches[table[0]] = DynamicCache(config=self.hf_config)
            elif table[0] not in self.caches:
                raise RuntimeError(f"no recurrent state for a sequence at position {pos[start]}")
            segments.append(Segment(start, end, self.caches[table[0]]))
        # a finished sequence's first block, now inside another's table: its state is
        # dead (a row's tail repeats its own last block, which may be its first)
        for table in tables:
            for block in table[1:]:
                if block != table[0]:
                    self.caches.pop(block, None)
        return segments


def keep_state_per_sequence(base_model: torch.nn.Module) -> int:
    """Wraps every stateful mixer of ``base_model``; returns how many there are.

    Raises UnsupportedModelError for a mixer whose forward takes no ``cache``
    argument (transformers before 5.24, or a release that renamed it again)."""
    wrapped = 0
    for module in base_model.modules():
        if type(module).__name__ in STATEFUL_MIXERS:
            taken = inspect.signature(module.forward).parameters
            if "cache" not in taken:
                import transformers

                raise UnsupportedModelError(
                    f"{type(module).__name__}.forward in transformers {transformers.__version__} "
                    "takes no cache argument: batchgen cannot hand it each sequence's state "
                    f"(its arguments: {', '.join(taken)}; transformers 5.24 or later takes it)"
                )
            module.forward = functools.partial(_per_sequence, module.forward)
            wrapped += 1
    return wrapped


def _per_sequence(forward: Any, hidden_states: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    """The wrapped forward: each sequence's tokens through the module with its own state."""
    segments = SEGMENTS.get()
    if segments is None:  # the probe: one stateless pass over its tokens
        return forward(hidden_states=hidden_states, cache=None, attention_mask=None)
    parts = [forward(hidden_states=hidden_states[:, s.start : s.end], cache=s.cache,
                     attention_mask=None) for s in segments]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
