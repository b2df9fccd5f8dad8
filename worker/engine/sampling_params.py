"""Sampling parameters of one request, checked when they are made.

Names, defaults and bounds are ``batchgen.jobs.schema.sampling.FIELDS``: the same
definition validates a request line at submit, so a value the queue accepted
is one the engine accepts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchgen.jobs.schema.constraints import StructuredOutput
from batchgen.jobs.schema.sampling import FIELDS, check, check_together


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. A ``seed`` makes sampling reproducible: the
    randomness for each token comes from (seed, position) alone, so the output
    does not depend on batch mates, preemption or which worker ran it.
    Raises ``ParamError`` (a ValueError) naming the field for a bad value.
    """

    # None: to the end of the context (a chat line's default, sampling.default_max_tokens)
    max_tokens: int | None = FIELDS["max_tokens"].default
    temperature: float = FIELDS["temperature"].default
    top_p: float = FIELDS["top_p"].default
    top_k: int = FIELDS["top_k"].default  # 0: off
    min_p: float = FIELDS["min_p"].default
    seed: int | None = FIELDS["seed"].default
    stop: Sequence[str] = FIELDS["stop"].default  # a string or a list; stored as a tuple
    stop_token_ids: Sequence[int] = FIELDS["stop_token_ids"].default
    ignore_eos: bool = FIELDS["ignore_eos"].default
    repetition_penalty: float = FIELDS["repetition_penalty"].default
    presence_penalty: float = FIELDS["presence_penalty"].default
    frequency_penalty: float = FIELDS["frequency_penalty"].default
    n: int = FIELDS["n"].default
    logprobs: int | None = FIELDS["logprobs"].default  # top-k logprobs to return per token
    # {token id: bias in [-100, 100]} added to the logits before sampling (greedy too);
    # kept as sorted (id, bias) pairs
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] | None = FIELDS[
        "logit_bias"
    ].default
    min_tokens: int = FIELDS["min_tokens"].default
    skip_special_tokens: bool = FIELDS["skip_special_tokens"].default
    # the text must follow this; a queue entry's one-key dict form is taken too
    structured_output: StructuredOutput | None = FIELDS["structured_output"].default

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None and (FIELDS[field.name].default is None or field.name == "max_tokens"):
                continue  # unset (max_tokens: no limit but the context)
            if field.name == "logit_bias" and isinstance(value, tuple):
                value = dict(value)  # already normalized (dataclasses.replace)
            value = check(field.name, list(value) if isinstance(value, tuple) else value)
            if field.name == "structured_output":
                value = StructuredOutput.from_spec(value)
            elif field.name == "logit_bias":  # {"id": bias} -> ((id, bias), ...)
                value = tuple(sorted((int(token), bias) for token, bias in value.items()))
            # lists become tuples: the params stay hashable and immutable
            object.__setattr__(self, field.name, tuple(value) if isinstance(value, list) else value)
        check_together({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple(self.logit_bias or ())  # type: ignore[arg-type]

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
