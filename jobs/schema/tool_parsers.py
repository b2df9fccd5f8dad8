"""Tool-call parsers: a generated answer in, the calls it wrote and the text around them out.

A job names one (``--tool-call-parser NAME``) or gets the one its checkpoint's chat
template makes unambiguous (``detect``); it reads the rows whose ``tool_choice`` is
``auto`` (tools.py). Parsers are strings in, strings out, beside the reasoning parsers
(reasoning.py): the worker gives the answer, the parser gives the text before the calls
and each call's function name and arguments (a JSON text). An output whose calls do not
parse (invalid JSON, no name) is kept as text with no calls: never an error.

Names, as vLLM's ``--tool-call-parser`` spells them:

- ``hermes``: Qwen2.5/Qwen3 (and Hermes) write each call as
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one after another;
  the last one's end tag may be missing (the model stopped at EOS).
- ``llama3_json``: Llama 3.1/3.2 write ``{"name": ..., "parameters": {...}}`` after the
  special ``<|python_tag|>`` (or as the whole answer), several joined by ``;``.
- ``mistral``: Mistral writes the special ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}`` (v3 tokenizers), or ``name[ARGS]{...}`` per call, each after
  its own ``[TOOL_CALLS]`` (v11+; ``name[CALL_ID]id[ARGS]{...}`` too). Its markers are
  special tokens, so this parser reads the output decoded with special tokens kept
  (``keeps_special``).
- ``openai``: gpt-oss writes each call as a harmony message to a function,
  ``<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
  {...}<|call|>`` (the recipient may also stand before the channel); the text is the
  final channel's message. Its markers are special tokens too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchgen.jobs.schema.errors import ParserError

NAMES = ("hermes", "llama3_json", "mistral", "openai")


@dataclass(frozen=True, slots=True)
class Call:
    """One call an output wrote: its function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Extracted:
    """An answer as the text outside its calls and the calls, in order (none: all text)."""

    text: str
    calls: list[Call] = field(default_factory=list)


def arguments_text(value: Any) -> str | None:
    """A call's arguments as JSON text: an object is serialized, a string that holds a
    JSON object kept; None for anything else (no call)."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            return value if isinstance(json.loads(value), dict) else None
        except ValueError:
            return None
    return None


def _call(value: Any, argument_keys: tuple[str, ...]) -> Call | None:
    """``{"name": ..., <an argument key>: {...}}`` as a call; None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    key = next((k for k in argument_keys if k in value), None)
    arguments = "{}" if key is None else arguments_text(value[key])
    return None if arguments is None else Call(value["name"], arguments)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def hermes(text: str) -> Extracted:
    """Qwen's ``<tool_call>{json}</tool_call>`` blocks; the text is what precedes the first."""
    start = text.find(HERMES_START)
    if start < 0:
        return Extracted(text)
    calls = []
    for match in _HERMES.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        call = _call(_loads(body.strip()), ("arguments",))
        if call is None:
            return Extracted(text)
        calls.append(call)
    return Extracted(text[:start], calls)


PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def llama3_json(text: str) -> Extracted:
    """Llama 3's ``{"name", "parameters"}`` objects (``;`` between them) as the answer."""
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return Extracted(text)
    calls, at = [], 0
    while at < len(body):
        try:
            value, end = _DECODER.raw_decode(body, at)
        except ValueError:
            return Extracted(text)
        call = _call(value, ("parameters", "arguments"))
        if call is None:
            return Extracted(text)
        calls.append(call)
        rest = body[end:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return Extracted(text)
        at = len(body) - len(rest[1:].lstrip())
    return Extracted("", calls)


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def mistral(text: str) -> Extracted:
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list, or ``name[ARGS]{...}`` each."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return Extracted(text)
    pieces = [p.strip() for p in text[start:].split(MISTRAL_CALLS)[1:]]
    calls: list[Call] = []
    for piece in pieces:
        found = _mistral_piece(piece)
        if not found:
            return Extracted(text)
        calls += found
    return Extracted(text[:start], calls)


def _mistral_piece(piece: str) -> list[Call]:
    """The calls after one ``[TOOL_CALLS]``; [] when they do not parse."""
    if piece.startswith("["):  # v3: a JSON list (an end-of-sequence token may follow it)
        try:
            value, _ = _DECODER.raw_decode(piece)
        except ValueError:
            return []
        if not isinstance(value, list) or not value:
            return []
        calls = [_call(item, ("arguments",)) for item in value]
        return [] if None in calls else [c for c in calls if c is not None]
    if MISTRAL_ARGS in piece:
        name, _, args = piece.partition(MISTRAL_ARGS)
        name = name.partition(MISTRAL_CALL_ID)[0]
    else:  # v11: name{json}
        brace = piece.find("{")
        name, args = (piece[:brace], piece[brace:]) if brace > 0 else ("", "")
    try:
        value, _ = _DECODER.raw_decode(args.strip())
    except ValueError:
        return []
    call = _call({"name": name.strip(), "arguments": value}, ("arguments",))
    return [call] if call is not None else []


HARMONY_START, HARMONY_MESSAGE, RECIPIENT = "<|start|>", "<|message|>", "to=functions."
HARMONY_ENDS = ("<|call|>", "<|end|>", "<|return|>")


def openai(text: str) -> Extracted:
    """gpt-oss's harmony messages addressed to functions; the final message is the text."""
    if RECIPIENT not in text:
        return Extracted(text)
    calls, final = [], ""
    for message in text.split(HARMONY_START):
        header, found, body = message.partition(HARMONY_MESSAGE)
        if not found:
            continue
        ends = [i for i in (body.find(end) for end in HARMONY_ENDS) if i >= 0]
        body = body[: min(ends)] if ends else body
        if RECIPIENT not in header:
            if "<|channel|>final" in header:
                final = body
            continue
        name = re.split(r"[\s<]", header.split(RECIPIENT, 1)[1], maxsplit=1)[0]
        call = _call({"name": name, "arguments": _loads(body.strip())}, ("arguments",))
        if call is None:
            return Extracted(text)
        calls.append(call)
    return Extracted(final, calls) if calls else Extracted(text)


@dataclass(frozen=True, slots=True)
class ToolParser:
    """A named parser; ``keeps_special``: it reads the output with special tokens kept."""

    name: str
    extract: Callable[[str], Extracted]
    keeps_special: bool = False


PARSERS = {
    "hermes": ToolParser("hermes", hermes),
    "llama3_json": ToolParser("llama3_json", llama3_json),
    "mistral": ToolParser("mistral", mistral, keeps_special=True),
    "openai": ToolParser("openai", openai, keeps_special=True),
}


def parser(name: str) -> ToolParser:
    """The parser a job's ``--tool-call-parser`` names; ParserError when none is."""
    found = PARSERS.get(name)
    if found is None:
        raise ParserError(f"unknown tool-call parser {name!r}: one of {', '.join(NAMES)}")
    return found


def detect(chat_template: str | None) -> str:
    """The parser a chat template makes unambiguous: ``hermes`` for one that writes
    ``<tool_call>``, ``mistral`` for ``[TOOL_CALLS]``, ``llama3_json`` for Llama 3's
    ``<|python_tag|>``, ``openai`` for gpt-oss's ``to=functions.``; "" for any other (no
    parser: auto rows stay text)."""
    if not chat_template:
        return ""
    marks = (("hermes", HERMES_START), ("mistral", MISTRAL_CALLS), ("llama3_json", PYTHON_TAG),
             ("openai", RECIPIENT))  # fmt: skip
    found = [name for name, mark in marks if mark in chat_template]
    return found[0] if len(found) == 1 else ""
