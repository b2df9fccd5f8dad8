"""What the loop needs from the engine, and loading the real one lazily.

The loop is written against ``EngineLike`` (the engine's public interface); the
real ``batchgen.worker.engine.Engine`` is imported only when a worker starts, so this
package imports without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from batchgen.worker.engine_config import EngineConfig


class EngineLike(Protocol):
    max_model_len: int

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]: ...

    def token_text(self, token_id: int) -> str: ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: Any,
        *,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
    ) -> None: ...

    def add_embedding(
        self, request_id: str, prompt: str | list[int], dimensions: int | None = None
    ) -> None: ...

    def step(self) -> list[Any]: ...

    def abort(self, request_id: str) -> Any: ...

    def drain(self) -> list[Any]: ...

    def has_unfinished(self) -> bool: ...

    def free_capacity(self) -> int: ...

    def stats(self) -> Any: ...


@dataclass(slots=True)
class EngineAPI:
    engine: EngineLike
    sampling_params: Callable[..., Any]  # SamplingParams(**request.sampling); ValueError when bad
    rejected: tuple[type[BaseException], ...]  # add_request's "can never run" errors


def load_engine(model: str, config: EngineConfig) -> EngineAPI:
    engine_package: Any = importlib.import_module("batchgen.worker.engine")
    engine = engine_package.Engine.from_config(model, config)
    return EngineAPI(engine, engine_package.SamplingParams, (engine_package.RequestRejected,))
