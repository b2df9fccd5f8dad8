"""A test double of the engine's public interface, for the queue loop's unit tests.

Never used in end-to-end tests. Deterministic: a request's k-th generated token
is ``(sum(prompt) + 7 * k) % 1000 + 10``; it finishes with "length" after
``max_tokens`` tokens (resumed ones included), or "stop" when the token is in
``stop_token_ids``. Each ``step`` generates one token for every running request.
Text is the tokens joined by spaces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchgen.worker.loop.engine_api import EngineLike


class RequestRejected(ValueError):
    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.reason = reason


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] | None = None
    samples: list[RequestOutput] = field(default_factory=list)  # the double never has n > 1
    embedding: list[float] | None = None


@dataclass
class EngineStats:
    num_steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0


@dataclass
class _Req:
    id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int]


def token_at(prompt: list[int], k: int) -> int:
    return (sum(prompt) + 7 * k) % 1000 + 10


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return [token_at(prompt, k) for k in range(max_tokens)]


@dataclass
class FakeEngine:
    max_num_seqs: int = 8
    max_model_len: int = 64
    tokens_per_step: int = 1
    running: dict[str, _Req] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)  # request ids, in admission order
    capacity_log: list[int] = field(default_factory=list)
    poison: str | None = None  # a prompt substring that kills the process in step()
    fail_step: bool = False
    on_step: Callable[[int], object] | None = None  # called with the step number before each step
    raise_on: str | None = None  # step() raises while a request with this prompt runs
    _stats: EngineStats = field(default_factory=EngineStats)

    def token_text(self, token_id: int) -> str:
        return str(token_id)

    def decode(self, token_ids: list[int], keep_special: bool = False) -> str:
        return " ".join(map(str, token_ids))

    def encode(
        self, prompt: str | list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:  # fmt: skip
        if isinstance(prompt, list):
            prompt = "".join(f"<{m['role']}>{m['content']}" for m in prompt) + "<assistant>"
        if "\x07" in prompt:
            raise ValueError("bell characters are not in the vocabulary")
        return [ord(c) % 256 for c in prompt]

    def add_embedding(
        self, request_id: str, prompt: str | list[int], dimensions: int | None = None
    ) -> None:
        raise RequestRejected(request_id, "the engine double does not embed")

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        resume_token_ids: list[int] | None = None,
        priority: int = 0,
        reasoning: Any = None,  # the double has no constraints to hold back
    ) -> None:
        assert isinstance(prompt, list)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise RequestRejected(
                request_id,
                f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > {self.max_model_len}",
            )
        self.running[request_id] = _Req(request_id, prompt, params, list(resume_token_ids or []))
        self.added.append(request_id)

    def _out(self, req: _Req, reason: str) -> RequestOutput:
        return RequestOutput(
            req.id, req.prompt, list(req.tokens), " ".join(map(str, req.tokens)), reason,
            len(req.prompt),
        )  # fmt: skip

    def step(self) -> list[RequestOutput]:
        import os

        if self.fail_step:
            raise RuntimeError("engine step failed")
        self._stats.num_steps += 1
        if self.on_step is not None:
            self.on_step(self._stats.num_steps)
        if self.raise_on is not None:
            bad = self.encode(self.raise_on)
            if any(req.prompt == bad for req in self.running.values()):
                raise RuntimeError("CUDA error: an illegal memory access (the double)")
        done = []
        for req in list(self.running.values()):
            if self.poison and any(self.poison == chr(t) for t in req.prompt[:1]):
                os._exit(99)
            for _ in range(self.tokens_per_step):
                tok = token_at(req.prompt, len(req.tokens))
                req.tokens.append(tok)
                if tok in req.params.stop_token_ids:
                    done.append(self._out(req, "stop"))
                    break
                if len(req.tokens) >= req.params.max_tokens:
                    done.append(self._out(req, "length"))
                    break
        for out in done:
            del self.running[out.request_id]
        return done

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.running.pop(request_id, None)
        return None if req is None else self._out(req, "abort")

    def drain(self) -> list[RequestOutput]:
        outs = [self._out(r, "abort") for r in self.running.values()]
        self.running.clear()
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def output_token_counts(self) -> dict[str, int]:
        return {rid: len(req.tokens) for rid, req in self.running.items()}

    def free_capacity(self) -> int:
        cap = self.max_num_seqs - len(self.running)
        self.capacity_log.append(cap)
        return cap

    def stats(self) -> EngineStats:
        self._stats.num_running = len(self.running)
        return self._stats


if TYPE_CHECKING:  # mypy checks the double against the interface the loop is written to
    _: EngineLike[SamplingParams] = FakeEngine()
