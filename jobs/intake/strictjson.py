"""Strict JSON for one input line, with the column of whatever is wrong.

Python's ``json`` accepts NaN and Infinity, keeps the last of duplicate keys,
turns 10,000-digit integers into a ValueError without a position, and recurses
on deep nesting. Here those are errors with a column. The fast path is
``json.loads`` with hooks; everything else only runs for lines that need it, and
all of it is linear in the line's length, with memory bounded by it:

- Depth and the number of values are checked before parsing (so a hostile line
  never builds a huge tree), on a skeleton of the line: escapes blanked (then a
  string is ``"[^"]*"`` whatever it holds, one regex match that keeps no
  backtracking state), strings cut out, then ``str.translate``. Only lines with
  more than MAX_DEPTH brackets, or long enough to hold more than MAX_VALUES
  values, pay for it.
- Columns are found after a failure, by ``jsonpos``, linear too.
"""

from __future__ import annotations

import gc
import json
import math
import re
from typing import Any

from batchgen.jobs.intake import jsonpos
from batchgen.jobs.schema.errors import JSONLineError, JSONValueRejected

MAX_DEPTH = 32  # objects/arrays nested inside each other
MAX_INT_DIGITS = 20  # enough for any 64-bit value
# Values (scalars, arrays, objects) and object keys in one line. Each costs at most
# ~200 bytes parsed, so this bounds a line's tree to ~25 MB whatever its shape; a
# 10,000-message chat with its metadata needs well under half of it.
MAX_VALUES = 200_000


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONValueRejected("duplicate", key)
            seen.add(key)
    return out


def _constant(name: str) -> Any:
    raise JSONValueRejected("constant", name)


def _int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise JSONValueRejected("bigint", text)
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONValueRejected("bigfloat", text)
    return value


_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs, parse_constant=_constant, parse_int=_int, parse_float=_float
)
_SCAN = _DECODER.scan_once  # type: ignore[attr-defined]


def loads(text: str) -> Any:
    """Parse ``text`` strictly; raise JSONLineError(column, message)."""
    opens = text.count("[") + text.count("{")
    if opens > MAX_DEPTH or (len(text) > MAX_VALUES and _may_have_too_many_values(text, opens)):
        _check_shape(text)
    try:
        return _paused(text) if opens > MAX_DEPTH and gc.isenabled() else _value(text)
    except JSONValueRejected as reject:
        raise _located(text, reject) from None
    except json.JSONDecodeError as exc:
        raise JSONLineError(exc.colno, f"malformed JSON: {exc.msg}") from None
    except RecursionError:  # unbalanced brackets nested past the decoder's recursion limit
        raise JSONLineError(max(jsonpos.too_deep_at(text, MAX_DEPTH), 0) + 1, _TOO_DEEP) from None


def _value(text: str) -> Any:
    """``_DECODER.decode(text)`` without its two Python calls and two regex matches,
    a twentieth of a line's validation: the C scanner straight away."""
    start = _SPACE.match(text).end() if text[:1] in " \t\r\n" else 0  # type: ignore[union-attr]
    try:
        value, end = _SCAN(text, start)
    except StopIteration as stop:
        raise json.JSONDecodeError("Expecting value", text, stop.value) from None
    if end != len(text):
        end = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if end != len(text):
            raise json.JSONDecodeError("Extra data", text, end)
    return value


def _paused(text: str) -> Any:
    """``_value`` with the cyclic collector paused. Parsed values hold no cycles, but
    each few hundred containers the decoder allocates start a collection that walks
    young objects, and now and then the whole heap: in a big process, a line of
    many containers would cost far more than its length."""
    gc.disable()
    try:
        return _value(text)
    finally:
        gc.enable()


def clip(text: str, limit: int = 60) -> str:
    """``repr`` of user text for a message, cut to about ``limit`` characters."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."


def _located(text: str, reject: JSONValueRejected) -> JSONLineError:
    if reject.kind == "duplicate":
        pos = jsonpos.duplicate_key(text, reject.detail)
        return JSONLineError(pos + 1, f"duplicate key {clip(reject.detail)}")
    pos = jsonpos.first_scalar(text, reject.detail)
    if reject.kind == "constant":
        return JSONLineError(pos + 1, f"{reject.detail} is not a valid JSON number")
    if reject.kind == "bigint":
        digits = len(reject.detail) - reject.detail.startswith("-")
        return JSONLineError(
            pos + 1, f"integer with {digits} digits (at most {MAX_INT_DIGITS} allowed)"
        )
    return JSONLineError(pos + 1, f"number {reject.detail[:40]} is out of range")


# -- shape checks: linear, at C speed ---------------------------------------------

_TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"
_TOO_MANY = f"more than {MAX_VALUES:,} JSON values and keys in one line"
# On blanked text a string holds no backslash: one match, no backtracking state.
# (An unterminated one runs to the end and stops the lexer.)
_STRING = re.compile(r'"[^"]*"')
_NO_SPACE = str.maketrans("", "", " \t\r\n")
# every other ASCII character dropped, and one kind of bracket (depth is all that counts)
_BRACKETS = str.maketrans("{}", "[]", "".join(chr(c) for c in range(128) if chr(c) not in "[]{}"))
_SPACE = re.compile(r"[ \t\r\n]*")


def _may_have_too_many_values(text: str, opens: int) -> bool:
    """Cheap bound: values and keys <= 1 + commas + colons + opens, strings <= quotes / 2."""
    marks = opens + text.count(",") + text.count(":")
    return marks >= MAX_VALUES or text.count('"') > 2 * MAX_VALUES


def _check_shape(text: str) -> None:
    """Nesting depth and the count of values and keys, at C speed on the line's
    skeleton: strings and spaces cut out, only structure and scalars left."""
    blanked = jsonpos.blank_escapes(text)
    if blanked.count('"') > 2 * MAX_VALUES + 2:
        raise JSONLineError(1, _TOO_MANY)  # more strings than values and keys allowed
    skeleton = _STRING.sub("", blanked).translate(_NO_SPACE)  # at most MAX_VALUES cuts
    del blanked
    if '"' in skeleton:
        return  # an unterminated string: malformed, which the decoder reports
    # each non-empty container holds one value more than it has commas
    opens = skeleton.count("[") + skeleton.count("{")
    empty = skeleton.count("[]") + skeleton.count("{}")
    if 1 + skeleton.count(",") + skeleton.count(":") + opens - empty > MAX_VALUES:
        raise JSONLineError(1, _TOO_MANY)
    brackets = skeleton.translate(_BRACKETS)
    for _ in range(MAX_DEPTH):  # each pass peels the innermost level
        if not brackets:
            return
        brackets = brackets.replace("[]", "")
    # Too deep, or out of order. Unbalanced is malformed, which the decoder reports;
    # balanced, the scan below costs at most the value count above.
    if brackets and brackets.count("[") == brackets.count("]"):
        at = jsonpos.too_deep_at(text, MAX_DEPTH)
        if at >= 0:
            raise JSONLineError(at + 1, _TOO_DEEP)
