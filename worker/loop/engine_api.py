"""What the loop needs from the engine, and loading the real one lazily.

The loop is written against ``EngineLike`` (the engine's public interface) and
reads what it hands back through ``EngineOutput`` and ``EngineCounters``; the
real ``batchgen.worker.engine.Engine`` satisfies them (mypy checks it in
``load_engine``), and so does the tests' double (tests/engine_double.py). The
engine is imported only when a worker starts, so this package imports without
torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import Field, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from batchgen.jobs.schema.reasoning import ReasoningParser
from batchgen.worker.engine_config import EngineConfig

Params = TypeVar("Params")  # the engine's sampling parameters, opaque to the loop
ParamsIn = TypeVar("ParamsIn", contravariant=True)


class EngineSample(Protocol):
    """One of an output's n completions."""

    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str: ...
    @property
    def logprobs(self) -> list[dict[int, float]] | None: ...


class EngineOutput(Protocol):
    """A finished (or aborted) request; the top-level fields are its first sample's."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str: ...  # "stop", "length" or "abort"
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def logprobs(self) -> list[dict[int, float]] | None: ...
    @property
    def samples(self) -> Sequence[EngineSample]: ...  # every sample when n > 1
    @property
    def embedding(self) -> list[float] | None: ...


class EngineCounters(Protocol):
    """The engine's counters, a dataclass: the heartbeat carries all its fields."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]

    @property
    def num_steps(self) -> int: ...
    @property
    def generation_tokens(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


class EngineLike(Protocol[ParamsIn]):
    @property
    def max_model_len(self) -> int: ...

    def encode(
        self, prompt: str | list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...  # fmt: skip

    def decode(self, token_ids: list[int], keep_special: bool = False) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: ParamsIn,
        *,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
        reasoning: ReasoningParser | None = None,  # its constraint starts after the reasoning
    ) -> None: ...

    def add_embedding(
        self, request_id: str, prompt: str | list[int], dimensions: int | None = None
    ) -> None: ...

    def step(self) -> Sequence[EngineOutput]: ...

    def abort(self, request_id: str) -> EngineOutput | None: ...

    def drain(self) -> Sequence[EngineOutput]: ...

    def has_unfinished(self) -> bool: ...

    def output_token_counts(self) -> dict[str, int]: ...

    def free_capacity(self) -> int: ...

    def stats(self) -> EngineCounters | None: ...  # None: an engine that keeps none


@dataclass(slots=True)
class EngineAPI(Generic[Params]):
    engine: EngineLike[Params]
    sampling_params: Callable[
        ..., Params
    ]  # SamplingParams(**request.sampling); ValueError when bad
    rejected: tuple[type[BaseException], ...]  # add_request's "can never run" errors
    # step's errors after which the engine cannot step again (a tensor-parallel rank lost):
    # no bisection, its requests go back charged as for a crash
    lost: tuple[type[BaseException], ...] = ()
    # stops what the engine started (a tensor-parallel engine's other ranks); a process
    # that loaded it calls this before it exits, so the ranks exit cleanly, not on a
    # closed connection
    close: Callable[[], None] = lambda: None


def load_engine(model: str, config: EngineConfig) -> EngineAPI[Any]:
    if TYPE_CHECKING:
        import batchgen.worker.engine as engine_package
    else:
        engine_package = importlib.import_module("batchgen.worker.engine")
    engine = engine_package.Engine.from_config(model, config)
    return EngineAPI(
        engine, engine_package.SamplingParams, (engine_package.RequestRejected,),
        (engine_package.GroupLost,), engine.close,
    )  # fmt: skip
