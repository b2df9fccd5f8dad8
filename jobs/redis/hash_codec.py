"""Records kept as Redis hashes: a ``@dataclass`` <-> one string per field, one codec.

Each field is stored by its declared type: ``bool`` as "1" / "0", ``int`` as its
digits, ``float`` as ``repr`` (it reads back exactly), ``str`` as itself, a ``str``
enum as its value, anything else (dicts, lists, optional values) as JSON. Reading,
a field the hash lacks (a record written before the field existed), or holds empty
where the type is not ``str``, takes its default. Per field, ``metadata=SORTED``
writes JSON with sorted keys, and ``metadata=OMIT_EMPTY`` leaves an empty value out
of the hash (one that another writer sets later with HSETNX).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar, get_type_hints

from batchgen.jobs.redis.keys import text_hash

SORTED = {"hash": "sorted"}
OMIT_EMPTY = {"hash": "omit_empty"}

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Field:
    name: str
    encode: Callable[[Any], str]
    decode: Callable[[str], Any]
    empty_is_value: bool  # "" is a value of the type (str), not a missing one
    omit_empty: bool


def _bool(value: Any) -> str:
    return "1" if value else "0"


def _field(name: str, kind: Any, role: str | None) -> _Field:
    encode: Callable[[Any], str]
    decode: Callable[[str], Any]
    if kind is bool:
        encode, decode = _bool, "1".__eq__
    elif kind in (int, str):
        encode, decode = str, kind
    elif kind is float:
        encode, decode = repr, float
    elif isinstance(kind, enum.EnumMeta):
        encode, decode = (lambda v: v.value), kind
    else:
        sort_keys = role == "sorted"
        encode, decode = (lambda v: json.dumps(v, sort_keys=sort_keys)), json.loads
    return _Field(name, encode, decode, kind is str, role == "omit_empty")


_PLANS: dict[type, tuple[_Field, ...]] = {}


def _plan(cls: type) -> tuple[_Field, ...]:
    if cls not in _PLANS:
        assert is_dataclass(cls), cls
        hints = get_type_hints(cls)  # the types themselves, not the strings annotations hold
        _PLANS[cls] = tuple(_field(f.name, hints[f.name], f.metadata.get("hash"))
                            for f in fields(cls))  # fmt: skip
    return _PLANS[cls]


def to_hash(record: Any) -> dict[str, str]:
    """Every field of the dataclass ``record`` as its stored string."""
    out = {}
    for f in _plan(type(record)):
        value = getattr(record, f.name)
        if value or not f.omit_empty:
            out[f.name] = f.encode(value)
    return out


def from_hash(cls: type[T], raw: object, **given: Any) -> T:
    """The ``cls`` record of a hash as HGETALL returns it; ``given`` fields are taken as
    they are (an id known from the record's key, say)."""
    data = text_hash(raw)
    values = dict(given)
    for f in _plan(cls):
        stored = data.get(f.name)
        if f.name not in values and stored is not None and (stored or f.empty_is_value):
            values[f.name] = f.decode(stored)
    return cls(**values)
