"""Sampling parameters: every field's name, default and bounds, defined once.

``FIELDS`` is the one definition: a request line's fields, the CLI's job
defaults and the engine's ``SamplingParams`` (which takes its defaults from
here and checks itself with ``check``) all use it, so ``--temperature -1``,
``"temperature": -1`` and ``SamplingParams(temperature=-1)`` fail alike.
Torch-free, like everything in ``jobs/``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchgen.jobs.schema.errors import ParamError

MAX_TOKENS_LIMIT = 1 << 20  # far above any context window; 10**9 is a typo
COMPLETION_MAX_TOKENS = 16  # OpenAI's completions default: a prompt line's max_tokens
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 64
MAX_SAMPLES = 16  # n
MAX_LOGPROBS = 20  # top logprobs per token
MAX_LOGIT_BIAS = 300  # entries
MAX_BIAS = 100.0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(
        value
    )


def _int_in(low: int, high: int, hint: str = "") -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> int:
        if not _is_int(value) or not low <= value <= high:
            raise ParamError(
                f"{name} must be an integer from {low} to {high}{hint}, got {show(value)}"
            )
        return int(value)

    return check


def _number_in(
    low: float, high: float, low_open: bool = False, what: str = ""
) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> float:
        ok = _is_number(value) and (low < value if low_open else low <= value) and value <= high
        if not ok:
            bounds = what or f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
            raise ParamError(f"{name} must be a number {bounds}, got {show(value)}")
        return float(value)

    return check


def _stop(name: str, value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ParamError(f"{name} must be a string or a list of strings, got {show(value)}")
    if len(items) > MAX_STOPS:
        raise ParamError(f"{name} has {len(items)} strings; at most {MAX_STOPS} allowed")
    for s in items:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ParamError(f"each {name} string must have 1 to {MAX_STOP_CHARS} characters")
    return list(items)


def _stop_token_ids(name: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < 1 << 31 for t in value):
        raise ParamError(f"{name} must be a list of token ids (integers >= 0), got {show(value)}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ParamError(f"{name} has {len(value)} ids; at most {MAX_STOP_TOKEN_IDS} allowed")
    return list(value)


def _logit_bias(name: str, value: Any) -> dict[str, float]:
    """{token id: bias}; JSON keys are strings, the Python API may give ints."""
    if not isinstance(value, dict):
        raise ParamError(f"{name} must be an object of token id -> bias, got {show(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ParamError(f"{name} has {len(value)} entries; at most {MAX_LOGIT_BIAS} allowed")
    out: dict[str, float] = {}
    for key, bias in value.items():
        token = key if _is_int(key) else int(key) if isinstance(key, str) and key.isdigit() else -1
        if not 0 <= token < 1 << 31:
            raise ParamError(f"{name} keys must be token ids (integers >= 0), got {show(key)}")
        if not _is_number(bias) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise ParamError(
                f"{name} values must be numbers from -{MAX_BIAS:g} to {MAX_BIAS:g}, got {show(bias)}"
            )
        out[str(token)] = float(bias)
    return out


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ParamError(f"{name} must be true or false, got {show(value)}")
    return value


def _structured(name: str, value: Any) -> dict[str, Any] | None:
    from batchgen.jobs.schema.constraints import check_field  # it imports this module

    return check_field(name, value)


# Where the grammar decides the end, these would cut a structured output short.
_NOT_WITH_STRUCTURED = ("stop", "stop_token_ids", "min_tokens")


def check_together(values: dict[str, Any]) -> None:
    """ParamError when two fields set in ``values`` cannot go together."""
    if values.get("structured_output"):
        for name in _NOT_WITH_STRUCTURED:
            if values.get(name):
                raise ParamError(
                    f"{name} cannot be combined with structured_output: the constraint "
                    "decides where the output ends"
                )


@dataclass(frozen=True, slots=True)
class Field:
    default: Any  # None: unset (no seed, no logprobs), and then not checked
    check: Callable[[str, Any], Any]  # (name, value) -> the normalized value, or ParamError
    in_lines: bool = True  # a request line and the CLI may set it; else the Python API only


FIELDS: dict[str, Field] = {
    # a prompt's default (the engine's too); a chat line's is default_max_tokens's
    "max_tokens": Field(COMPLETION_MAX_TOKENS, _int_in(1, MAX_TOKENS_LIMIT)),
    # greedy unless asked: a batch rerun gives the same rows
    "temperature": Field(0.0, _number_in(0.0, 100.0)),
    "top_p": Field(1.0, _number_in(0.0, 1.0, low_open=True, what="in (0, 1]")),
    "top_k": Field(0, _int_in(0, 1 << 20, " (0 turns it off)")),
    "min_p": Field(0.0, _number_in(0.0, 1.0)),
    "seed": Field(None, _int_in(0, (1 << 63) - 1)),
    "stop": Field((), _stop),
    "stop_token_ids": Field((), _stop_token_ids),
    "ignore_eos": Field(False, _bool),
    "repetition_penalty": Field(1.0, _number_in(0.0, 100.0, low_open=True)),
    "presence_penalty": Field(0.0, _number_in(-2.0, 2.0)),
    "frequency_penalty": Field(0.0, _number_in(-2.0, 2.0)),
    "n": Field(1, _int_in(1, MAX_SAMPLES)),
    # top alternatives per generated token; 0: the chosen token's logprob alone
    "logprobs": Field(None, _int_in(0, MAX_LOGPROBS)),
    "logit_bias": Field(None, _logit_bias),
    "min_tokens": Field(0, _int_in(0, MAX_TOKENS_LIMIT), in_lines=False),
    "skip_special_tokens": Field(True, _bool, in_lines=False),
    # one constraint (jobs.structured); a line may also write OpenAI's response_format
    "structured_output": Field(None, _structured),
}

# What a request line may set, and the check of each.
CHECKS: dict[str, Callable[[str, Any], Any]] = {
    name: f.check for name, f in FIELDS.items() if f.in_lines
}
# Written into every job when neither the CLI nor the line says otherwise (max_tokens
# is not: its default depends on the line, default_max_tokens).
DEFAULTS: dict[str, Any] = {
    name: FIELDS[name].default for name in ("temperature", "top_p", "top_k")
}


def default_max_tokens(chat: bool) -> int | None:
    """A request's max_tokens when neither its line nor its job gives one, as OpenAI's
    defaults are: a chat answer runs to its end (EOS, a stop) or to the end of the
    context (None, which the engine's SamplingParams takes so), a prompt gets 16."""
    return None if chat else COMPLETION_MAX_TOKENS


def check(name: str, value: Any) -> Any:
    """The normalized value, or ParamError."""
    return FIELDS[name].check(name, value)


def job_defaults(overrides: dict[str, Any]) -> dict[str, Any]:
    """DEFAULTS updated with the CLI's values (None = not given), each checked."""
    out = dict(DEFAULTS)
    for name, value in overrides.items():
        if value is None or value == () or value == []:
            continue
        try:
            out[name] = check(name, list(value) if isinstance(value, tuple) else value)
        except ParamError as exc:
            flag = "--" + name.replace("_", "-")
            raise ParamError(f"{flag}: {exc}") from None
    return out


def show(value: Any) -> str:
    """A value as JSON, cut short for an error message."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."
