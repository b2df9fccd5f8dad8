"""Strict JSON for one input line, with the column of whatever is wrong.

Python's ``json`` accepts NaN and Infinity, keeps the last of duplicate keys,
turns 10,000-digit integers into a ValueError without a position, and recurses
on deep nesting. Here those are errors with a column. The fast path is
``json.loads`` with hooks; the slow lexer below only runs to find the column
once something is known to be wrong (or when a line has enough brackets that it
could nest too deep).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

MAX_DEPTH = 32  # objects/arrays nested inside each other
MAX_INT_DIGITS = 20  # enough for any 64-bit value


class JSONLineError(ValueError):
    def __init__(self, column: int, message: str) -> None:
        super().__init__(message)
        self.column = column
        self.message = message


class _Reject(Exception):
    """Raised inside a json hook; ``locate`` finds its column afterwards."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind
        self.detail = detail


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Reject("duplicate", key)
            seen.add(key)
    return out


def _constant(name: str) -> Any:
    raise _Reject("constant", name)


def _int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise _Reject("bigint", text)
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Reject("bigfloat", text)
    return value


_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_int, parse_float=_float
)


def loads(text: str) -> Any:
    """Parse ``text`` strictly; raise JSONLineError(column, message)."""
    if text.count("[") + text.count("{") > MAX_DEPTH:
        _check_depth(text)
    try:
        return _DECODER.decode(text)
    except _Reject as reject:
        raise _located(text, reject) from None
    except json.JSONDecodeError as exc:
        raise JSONLineError(exc.colno, f"malformed JSON: {exc.msg}") from None
    except RecursionError:  # pragma: no cover - _check_depth catches this first
        raise JSONLineError(1, f"nested deeper than {MAX_DEPTH} levels") from None


def _located(text: str, reject: _Reject) -> JSONLineError:
    if reject.kind == "duplicate":
        pos = _duplicate_key_pos(text, reject.detail)
        return JSONLineError(pos + 1, f"duplicate key {reject.detail!r}")
    if reject.kind == "constant":
        pos = _first_token(text, lambda kind, tok: kind == "literal" and tok == reject.detail)
        return JSONLineError(pos + 1, f"{reject.detail} is not a valid JSON number")
    if reject.kind == "bigint":
        pos = _first_token(text, lambda kind, tok: kind == "number" and tok == reject.detail)
        digits = len(reject.detail) - reject.detail.startswith("-")
        return JSONLineError(
            pos + 1, f"integer with {digits} digits (at most {MAX_INT_DIGITS} allowed)"
        )
    pos = _first_token(text, lambda kind, tok: kind == "number" and tok == reject.detail)
    return JSONLineError(pos + 1, f"number {reject.detail[:40]} is out of range")


# -- the slow lexer: positions only -------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERAL = re.compile(r"-?Infinity|NaN|true|false|null")
_SPACE = re.compile(r"[ \t\r\n]*")


def tokens(text: str) -> Iterator[tuple[str, str, int]]:
    """(kind, token, position) for each token; stops at anything unlexable."""
    pos, end = 0, len(text)
    while True:
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos >= end:
            return
        char = text[pos]
        if char == '"':
            match = _STRING.match(text, pos)
            if match is None:
                return
            yield "string", match.group(), pos
            pos = match.end()
        elif char in "{}[],:":
            yield "punct", char, pos
            pos += 1
        else:
            match = _LITERAL.match(text, pos) or _NUMBER.match(text, pos)
            if match is None:
                return
            kind = "number" if match.re is _NUMBER else "literal"
            yield kind, match.group(), pos
            pos = match.end()


def _first_token(text: str, want) -> int:
    for kind, tok, pos in tokens(text):
        if want(kind, tok):
            return pos
    return 0


def _check_depth(text: str) -> None:
    depth = 0
    for kind, tok, pos in tokens(text):
        if kind != "punct":
            continue
        if tok in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise JSONLineError(pos + 1, f"nested deeper than {MAX_DEPTH} levels")
        elif tok in "]}":
            depth -= 1


def _duplicate_key_pos(text: str, key: str) -> int:
    stack: list[set[str] | None] = []  # a key set per open object, None per array
    previous: tuple[str, str, int] | None = None
    for kind, tok, pos in tokens(text):
        if kind == "punct" and tok == "{":
            stack.append(set())
        elif kind == "punct" and tok == "[":
            stack.append(None)
        elif kind == "punct" and tok in "]}":
            if stack:
                stack.pop()
        elif kind == "punct" and tok == ":" and previous and previous[0] == "string":
            keys = stack[-1] if stack else None
            name = json.loads(previous[1])
            if keys is not None:
                if name in keys and name == key:
                    return previous[2]
                keys.add(name)
        previous = (kind, tok, pos)
    return 0


def value_position(text: str, path: tuple[str | int, ...], key: bool = False) -> int:
    """Column (1-based) of the value at ``path`` (keys and list indices), or of its
    key when ``key``; else of its deepest present ancestor. Only for text that
    ``loads`` accepted."""
    best = 0
    for pos, key_pos, at in _values(text):
        if at == path:
            return (key_pos if key else pos) + 1
        if path[: len(at)] == at:
            best = max(best, pos)
    return best + 1


def _values(text: str) -> list[tuple[int, int, tuple[str | int, ...]]]:
    """(position, key position, path) of the start of every value, in document order."""
    toks = list(tokens(text))
    out: list[tuple[int, int, tuple[str | int, ...]]] = []
    i = 0

    def value(path: tuple[str | int, ...], key_pos: int) -> None:
        nonlocal i
        kind, tok, pos = toks[i]
        out.append((pos, key_pos, path))
        i += 1
        if kind != "punct":
            return
        close = "}" if tok == "{" else "]"
        if toks[i][1] == close:
            i += 1
            return
        index = 0
        while True:
            if tok == "{":
                key, at = json.loads(toks[i][1]), toks[i][2]
                i += 2  # the key and the colon
                value((*path, key), at)
            else:
                value((*path, index), toks[i][2])
                index += 1
            sep = toks[i][1]
            i += 1
            if sep == close:
                return

    value((), 0)
    return out
