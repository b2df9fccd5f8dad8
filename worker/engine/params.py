"""Sampling parameters of one request, checked when they are made."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. A ``seed`` makes sampling reproducible: the
    randomness for each token comes from (seed, position) alone, so the output
    does not depend on batch mates, preemption or which worker ran it.
    """

    max_tokens: int = 16
    temperature: float = 0.0  # greedy unless asked: a batch rerun gives the same rows
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()  # stored as a tuple
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: int = 1
    logprobs: int | None = None  # top-k logprobs to return per token
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # accept lists (and one stop string) from callers; keep hashable tuples
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        def number(name: str, value: object) -> float:
            check(
                isinstance(value, (int, float)) and not isinstance(value, bool),
                f"{name} must be a number, got {value!r}",
            )
            assert isinstance(value, (int, float))
            check(math.isfinite(value), f"{name} must be finite, got {value!r}")
            return float(value)

        def integer(name: str, value: object) -> int:
            check(
                isinstance(value, int) and not isinstance(value, bool),
                f"{name} must be an integer, got {value!r}",
            )
            assert isinstance(value, int)
            return value

        check(
            integer("max_tokens", self.max_tokens) >= 1,
            f"max_tokens must be >= 1, got {self.max_tokens}",
        )
        check(
            number("temperature", self.temperature) >= 0,
            f"temperature must be >= 0, got {self.temperature}",
        )
        check(0 < number("top_p", self.top_p) <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(integer("top_k", self.top_k) >= 0, f"top_k must be >= 0 (0 is off), got {self.top_k}")
        check(0 <= number("min_p", self.min_p) <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(
            number("repetition_penalty", self.repetition_penalty) > 0,
            "repetition_penalty must be > 0",
        )
        number("presence_penalty", self.presence_penalty)
        number("frequency_penalty", self.frequency_penalty)
        check(integer("n", self.n) >= 1, f"n must be >= 1, got {self.n}")
        check(integer("min_tokens", self.min_tokens) >= 0, "min_tokens must be >= 0")
        if self.seed is not None:
            integer("seed", self.seed)
        if self.logprobs is not None:
            check(integer("logprobs", self.logprobs) >= 0, "logprobs must be >= 0")
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop must be a list of non-empty strings",
        )
        check(
            all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0
                for t in self.stop_token_ids
            ),
            "stop_token_ids must be non-negative integers",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
