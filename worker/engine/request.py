"""One request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen.worker.engine.detokenizer import StopStringMatcher
from batchgen.worker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from batchgen.worker.engine.constrained import AnswerGate


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class EngineFinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # taken out by abort()/drain(), tokens so far kept


@dataclass(slots=True, eq=False)
class EmbedTask:
    """What makes a request an embedding: prefill only, it never decodes.

    ``state`` is the pooling's running state over the positions computed so
    far (``pooling.pool_step``), reset when the request is preempted;
    ``vector`` is set once the whole prompt is computed.
    """

    dimensions: int | None = None  # keep the first this many values (Matryoshka)
    state: Any = None  # fp32 tensor on the model's device
    vector: list[float] | None = None


@dataclass(slots=True, eq=False)
class EngineRequest:
    """Prompt and output live in one token list; prefill is not a separate kind.

    The engine computes tokens until ``num_computed_tokens`` catches up with
    ``len(token_ids)``; chunked prefill, prefix hits, resumed and preempted
    requests all take that same path.
    """

    request_id: str
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    arrival_order: int  # FCFS tie-break; kept across preemptions
    priority: int = 0  # lower runs first
    sample_index: int = 0  # which of the n samples (seeded draws differ per sample)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_resumed_tokens: int = 0  # generated elsewhere before, handed to us
    finish_reason: EngineFinishReason | None = None
    num_hashed_blocks: int = 0  # head of block_table already in the prefix cache
    # head of block_table handed back: slid out of every layer's window (kv_window.py)
    num_released_blocks: int = 0
    admitted: bool = False  # set on first admission; num_cached_tokens is measured then
    logprobs: list[dict[int, float]] | None = None
    stop_text: str | None = None  # text cut at a stop string
    stop_matcher: StopStringMatcher | None = None  # when params.stop is set
    matcher: Any = None  # llguidance LLMatcher when params.structured_output is set
    # set instead of the matcher while a request that reasons first has not ended its reasoning
    answer_gate: AnswerGate | None = None
    embed: EmbedTask | None = None  # set for an embedding request

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(slots=True)
class Sample:
    """One of the n completions of a request."""

    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished (or aborted) request. The top-level fields are the first sample's."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int
    logprobs: list[dict[int, float]] | None = None
    samples: list[Sample] = field(default_factory=list)
    # an embedding request's vector (token_ids empty, text ""); None for generation
    embedding: list[float] | None = None
