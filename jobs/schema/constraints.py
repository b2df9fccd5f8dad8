"""Structured output: the constraint a request's text must follow, checked once.

A constraint is one of five kinds, written in a request line (or by the Python
API) as a one-key object:

- ``{"json": SCHEMA}``: a JSON Schema (draft 2020-12 subset llguidance knows)
- ``{"json_object": true}``: any JSON object
- ``{"regex": "..."}``: a regular expression (Rust regex syntax) the whole text matches
- ``{"choice": ["yes", "no"]}``: exactly one of these strings
- ``{"grammar": "..."}``: a Lark grammar (llguidance's dialect: ``start: ...``,
  ``"literals"``, ``/regexes/``, ``%json { schema }`` embeds)

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) maps
onto the same forms. Grammars are compiled by llguidance (no torch): submit
compiles each distinct constraint once to refuse a bad one before anything is
queued; workers compile it again against their tokenizer and cache it by
``key``. Generated JSON is compact (no whitespace between tokens) and strict.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from batchgen.jobs.schema.errors import ParamError
from batchgen.jobs.schema.sampling import show

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1000
MAX_CHOICE_CHARS = 1000
# compact, strict JSON: no whitespace between tokens, so a random model cannot
# wander in it, and strings never take raw control characters
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_COMPILED_LIMIT = 1024  # distinct constraints whose compile result a process remembers


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Exactly one of the fields is set: the output must follow it.

    ``json`` takes a schema as a dict or as its JSON text and keeps it as
    canonical JSON text (so the object stays hashable); ``choice`` becomes a
    tuple. Raises ``ParamError`` (a ValueError) for a bad constraint,
    including a schema, regex or grammar that does not compile.
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = {
            kind: value
            for kind, value in (
                ("json", self.json), ("json_object", self.json_object or None),
                ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar),
            )
            if value is not None
        }  # fmt: skip
        if len(given) != 1:
            raise ParamError(f"give exactly one of {', '.join(KINDS)}")
        kind, value = next(iter(given.items()))
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ParamError(f"json: the schema is not valid JSON ({exc})") from None
        spec = check_spec({kind: value})
        if kind == "json":
            object.__setattr__(self, "json", _canonical(spec["json"]))
        elif kind == "choice":
            object.__setattr__(self, "choice", tuple(spec["choice"]))

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> StructuredOutput:
        """From the one-key form a request line (or queue entry) holds."""
        return cls(**spec)

    @property
    def kind(self) -> str:
        return next(iter(self.spec))

    @property
    def spec(self) -> dict[str, Any]:
        """The one-key form, as a queue entry carries it."""
        if self.json is not None:
            return {"json": json.loads(self.json)}
        if self.json_object:
            return {"json_object": True}
        if self.regex is not None:
            return {"regex": self.regex}
        if self.choice is not None:
            return {"choice": list(self.choice)}
        return {"grammar": self.grammar}

    @property
    def key(self) -> str:
        """Content hash: equal constraints share one compiled grammar."""
        return spec_key(self.spec)


def check_field(name: str, value: Any) -> dict[str, Any] | None:
    """``params.FIELDS``' check of ``structured_output`` (null: no constraint)."""
    if value is None:
        return None
    try:
        return check_spec(value)
    except ParamError as exc:
        raise ParamError(f"{name}: {exc}") from None


def check_spec(value: Any) -> dict[str, Any]:
    """The normalized one-key form of a constraint, compiled once; ParamError if bad."""
    if isinstance(value, StructuredOutput):
        return value.spec
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in KINDS:
        raise ParamError(
            f"must be an object with exactly one of {', '.join(KINDS)}, got {show(value)}"
        )
    kind, arg = next(iter(value.items()))
    if kind == "json":
        if not isinstance(arg, dict):
            raise ParamError(f"json must be a JSON Schema object, got {show(arg)}")
    elif kind == "json_object":
        if arg is not True:
            raise ParamError(f"json_object must be true, got {show(arg)}")
    elif kind in ("regex", "grammar"):
        if not isinstance(arg, str) or not arg:
            raise ParamError(f"{kind} must be a non-empty string, got {show(arg)}")
    else:
        _check_choices(arg)
        arg = list(arg)
    spec = {kind: arg}
    error = _compile_error(spec)
    if error:
        raise ParamError(f"{kind} does not compile: {error}")
    return spec


def from_response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` -> the one-key form (None for ``{"type": "text"}``)."""
    if not isinstance(value, dict) or "type" not in value:
        raise ParamError(
            'response_format must be {"type": "text" | "json_object" | "json_schema", ...}'
        )
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"} if kind == "json_schema" else set(value) - {"type"}
    if extra:
        raise ParamError(f"response_format has unknown field {sorted(extra)[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return check_spec({"json_object": True})
    if kind != "json_schema":
        raise ParamError(
            f'response_format.type must be "text", "json_object" or "json_schema", got {show(kind)}'
        )
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
        raise ParamError('response_format.json_schema must be {"name", "schema": {...}}')
    unknown = set(inner) - {"name", "schema", "strict", "description"}
    if unknown:
        raise ParamError(f"response_format.json_schema has unknown field {sorted(unknown)[0]!r}")
    if not isinstance(inner.get("name", ""), str) or not isinstance(
        inner.get("strict", True), bool
    ):
        raise ParamError("response_format.json_schema: name is a string, strict a boolean")
    try:
        return check_spec({"json": inner["schema"]})
    except ParamError as exc:
        raise ParamError(f"response_format.json_schema.schema: {exc}") from None


def kind_of(spec: dict[str, Any] | None) -> str | None:
    """The ``structured`` column's value for a queue entry's constraint."""
    return next(iter(spec)) if spec else None


def spec_key(spec: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(spec).encode()).hexdigest()


def grammar_text(spec: dict[str, Any]) -> str:
    """The llguidance grammar of a one-key constraint (what the matcher compiles)."""
    from llguidance import LLMatcher

    kind, arg = next(iter(spec.items()))
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(arg, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if kind == "regex":
        return LLMatcher.grammar_from_regex(arg)
    if kind == "choice":  # Lark string literals take JSON's escapes
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in arg)
        return LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return LLMatcher.grammar_from_lark(arg)


_compiled: OrderedDict[str, str] = OrderedDict()  # key -> compile error ("" when fine)


def _compile_error(spec: dict[str, Any]) -> str:
    """llguidance's error for a constraint ("" if it compiles), each distinct one compiled once."""
    key = spec_key(spec)
    if key in _compiled:
        _compiled.move_to_end(key)
        return _compiled[key]
    from llguidance import LLMatcher

    try:
        error = LLMatcher.validate_grammar(grammar_text(spec))
    except ValueError as exc:  # a schema that is not a JSON object at all
        error = str(exc)
    _compiled[key] = _one_line(error, keep_position=next(iter(spec)) == "grammar")
    if len(_compiled) > _COMPILED_LIMIT:
        _compiled.popitem(last=False)
    return _compiled[key]


def _one_line(error: str, keep_position: bool) -> str:
    """llguidance's message without its source excerpt; a position only where it is
    the user's own grammar (else it points into the grammar made from their input)."""
    lines = [line.strip() for line in error.strip().splitlines()]
    kept = [lines[0], *(line for line in lines[1:] if line.startswith("error:"))] if lines else []
    text = " ".join(kept)
    if not keep_position:
        text = re.sub(r"^at \d+\(\d+\): ", "", text)
    return text if len(text) <= 300 else text[:297] + "..."


def _check_choices(value: Any) -> None:
    if not isinstance(value, (list, tuple)) or not value:
        raise ParamError(f"choice must be a non-empty list of strings, got {show(value)}")
    if len(value) > MAX_CHOICES:
        raise ParamError(f"choice has {len(value)} strings; at most {MAX_CHOICES}")
    for c in value:
        if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
            raise ParamError(f"each choice must be a string of 1 to {MAX_CHOICE_CHARS} characters")
    if len(set(value)) != len(value):
        raise ParamError("choice lists a string twice")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
