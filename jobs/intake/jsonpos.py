"""Where things are in a line of JSON: the position of whatever ``strictjson`` or a
field check found wrong, for its column.

Everything here is linear in the line, with memory bounded by its nesting
depth: tokens come one at a time from ``finditer`` over the line with its escapes
blanked (then a string is ``"[^"]*"``, one match that keeps no backtracking state
however long it is), and a field's siblings are skipped whole by the C decoder.
Positions are 0-based.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

_STRUCTURE = re.compile(r'"[^"]*"?|[\[\]{}]')  # an unterminated string runs to the end
_KEYS = re.compile(r'"[^"]*"?|[\[\]{}:]')
_SPACE = re.compile(r"[ \t\r\n]*")
# Left to right, each backslash starts one escape, so in ``\\ud800`` (a backslash,
# then text) there is no surrogate.
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_SKIPPER = json.JSONDecoder()  # only for text the strict decoder accepted


def blank_escapes(text: str) -> str:
    """``text`` with each escaped backslash or quote replaced by two underscores: same
    positions, and every quote left delimits a string. (``replace`` pairs a run of
    backslashes from its left, as JSON does.)"""
    if "\\" not in text:
        return text
    return text.replace("\\\\", "__").replace('\\"', "__")


def _lex(pattern: re.Pattern[str], text: str) -> Iterator[tuple[str, int, int]]:
    """(first character, start, end) of each token ``pattern`` finds in ``text``;
    stops at an unterminated string."""
    blanked = blank_escapes(text)
    for match in pattern.finditer(blanked):
        start, end = match.span()
        char = blanked[start]
        if char == '"' and (end - start < 2 or blanked[end - 1] != '"'):
            return
        yield char, start, end


def too_deep_at(text: str, max_depth: int) -> int:
    """Position of the first bracket nested deeper than ``max_depth``, or -1."""
    depth = 0
    for char, start, _ in _lex(_STRUCTURE, text):
        if char in "[{":
            depth += 1
            if depth > max_depth:
                return start
        elif char in "]}":
            depth -= 1
    return -1


def first_scalar(text: str, token: str) -> int:
    """Position of the first number or literal spelled ``token``: the regex skips
    strings and stops only there, not at every token."""
    alone = f"(?<![0-9A-Za-z.+-]){re.escape(token)}(?![0-9A-Za-z.+-])"
    for char, start, _ in _lex(re.compile(f'"[^"]*"?|{alone}'), text):
        if char != '"':
            return start
    return 0


def duplicate_key(text: str, key: str) -> int:
    """Position of the first repeat of ``key`` within one object. Memory: one flag
    per open container, not the keys seen."""
    seen_key: list[bool | None] = []  # per open object: key seen yet; None per array
    string: tuple[int, int] | None = None  # the string just before, a key if ':' follows
    for char, start, end in _lex(_KEYS, text):
        if char == '"':
            string = (start, end)
            continue
        if char == ":" and string and seen_key and seen_key[-1] is not None:
            if _key_text(text, *string) == key:
                if seen_key[-1]:
                    return string[0]
                seen_key[-1] = True
        elif char in "[{":
            seen_key.append(False if char == "{" else None)
        elif char in "]}" and seen_key:
            seen_key.pop()
        string = None
    return 0


def _key_text(text: str, start: int, end: int) -> str:
    raw = text[start:end]
    return raw[1:-1] if "\\" not in raw else json.loads(raw)


def lone_surrogate(text: str) -> int:
    """Position of the first \\u escape of half a surrogate pair with no other half."""
    high = high_end = -1  # the \\uD800-\\uDBFF escape waiting for its low half
    for match in _ESCAPE.finditer(text):
        code = int(match.group(1), 16) if match.group(1) else -1
        is_low = 0xDC00 <= code <= 0xDFFF
        if high >= 0:
            if is_low and match.start() == high_end:
                high = -1
                continue
            return high
        if 0xD800 <= code <= 0xDBFF:
            high, high_end = match.start(), match.end()
        elif is_low:
            return match.start()
    return max(high, 0)


def value_position(text: str, path: tuple[str | int, ...], key: bool = False) -> int:
    """Column (1-based) of the value at ``path`` (keys and list indices), or of its
    key when ``key``; else of its deepest present ancestor. Only for text that
    ``strictjson.loads`` accepted: siblings off the path are skipped whole."""
    pos = _SPACE.match(text).end()  # type: ignore[union-attr]
    key_pos = pos
    for step in path:
        found = _child(text, pos, step)
        if found is None:
            return pos + 1
        pos, key_pos = found
    return (key_pos if key else pos) + 1


def _child(text: str, pos: int, step: str | int) -> tuple[int, int] | None:
    """(value position, key position) of member ``step`` of the object or array
    at ``pos``, or None if there is none."""
    is_object = isinstance(step, str)
    if text[pos] != ("{" if is_object else "["):
        return None
    skip, space = _SKIPPER.raw_decode, _SPACE.match
    i = space(text, pos + 1).end()  # type: ignore[union-attr]
    index = 0
    while text[i] not in "]}":
        at = i
        if is_object:
            name, i = skip(text, i)
            i = space(text, i).end() + 1  # type: ignore[union-attr]  # past the colon
            i = space(text, i).end()  # type: ignore[union-attr]
            if name == step:
                return i, at
        elif index == step:
            return i, at
        _, i = skip(text, i)
        i = space(text, i).end()  # type: ignore[union-attr]
        if text[i] == ",":
            i = space(text, i + 1).end()  # type: ignore[union-attr]
        index += 1
    return None
