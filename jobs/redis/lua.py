"""Lua scripts people can read: named KEYS and ARGV, a header, run by redis-py's Script.

Every script batchgen runs is a ``LuaScript``: its KEYS and ARGV are declared by
name, and the source Redis receives starts with a header listing them, then
``local`` bindings of those names, so a body never counts offsets::

    -- batchgen: cancel
    -- KEYS[1] job: the job record
    -- ARGV[1] job_id
    local job = KEYS[1]
    local job_id = ARGV[1]

A name written ``*name`` (last only) takes the rest: ``KEYS[2..]`` or
``ARGV[2..]`` as a Lua list. Variable-sized data (rows of a commit, entries
handed back) travel as one JSON argument decoded with ``cjson``, not as flat
lists with hand-counted strides. Scripts are called by keyword with the same
names (``CANCEL(conn, job=..., job_id=...)``).

Calls go through redis-py's ``Script``: EVALSHA, and on a NOSCRIPT reply (a new
or restarted server, a promoted replica, SCRIPT FLUSH) SCRIPT LOAD and EVALSHA
again; a flush between those two (NOSCRIPT again) sends the source with EVAL. Called with a pipeline for ``conn``, the script is queued and the pipeline
loads whatever the server lacks before it executes.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.commands.core import Script

Value = str | int | float | bytes


@dataclass(frozen=True, slots=True)
class Param:
    name: str  # a Lua identifier; "*name" takes the rest as a list (last only)
    doc: str = ""

    @property
    def rest(self) -> bool:
        return self.name.startswith("*")

    @property
    def ident(self) -> str:
        return self.name.lstrip("*")


def _params(items: Sequence[str | tuple[str, str]]) -> tuple[Param, ...]:
    out = tuple(Param(*item) if isinstance(item, tuple) else Param(item) for item in items)
    assert all(not p.rest for p in out[:-1]), "only the last parameter may take the rest"
    return out


@dataclass(frozen=True, slots=True)
class LuaScript:
    """One script: what it is for, its KEYS and ARGV by name, a prelude, its body."""

    name: str
    keys: tuple[Param, ...]
    args: tuple[Param, ...]
    body: str
    prelude: str = ""  # shared Lua functions (see lifecycle.LUA_PRELUDE)
    source: str = field(init=False)
    script: Script = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", self._render())
        # No registered client: every call names its connection, and the source goes
        # in as bytes, so redis-py never asks a client for an encoder to hash it.
        script = Script(None, self.source.encode())  # type: ignore[arg-type]
        object.__setattr__(self, "script", script)

    @classmethod
    def define(
        cls,
        name: str,
        *,
        keys: Sequence[str | tuple[str, str]],
        args: Sequence[str | tuple[str, str]] = (),
        body: str,
        prelude: str = "",
    ) -> LuaScript:
        return cls(name, _params(keys), _params(args), body, prelude)

    def _render(self) -> str:
        lines = [f"-- batchgen: {self.name}"]
        for table, params in (("KEYS", self.keys), ("ARGV", self.args)):
            for i, p in enumerate(params, start=1):
                where = f"{table}[{i}..]" if p.rest else f"{table}[{i}]"
                lines.append(f"-- {where} {p.ident}" + (f": {p.doc}" if p.doc else ""))
        lines.append(self.prelude.strip())
        for table, params in (("KEYS", self.keys), ("ARGV", self.args)):
            for i, p in enumerate(params, start=1):
                if p.rest:  # a loop, not unpack(): unpack overflows Lua's stack on long lists
                    lines.append(f"local {p.ident} = {{}}")
                    lines.append(
                        f"for i = {i}, #{table} do {p.ident}[#{p.ident} + 1] = {table}[i] end"
                    )
                else:
                    lines.append(f"local {p.ident} = {table}[{i}]")
        lines.append(self.body.strip())
        return "\n".join(line for line in lines if line) + "\n"

    def flatten(self, given: dict[str, Any]) -> tuple[list[str | bytes], list[Value]]:
        """(keys, args) in declared order from keyword values; a rest name takes a list."""
        missing = [p.ident for p in (*self.keys, *self.args) if p.ident not in given]
        extra = set(given) - {p.ident for p in (*self.keys, *self.args)}
        if missing or extra:
            raise TypeError(f"script {self.name}: missing {missing}, unexpected {sorted(extra)}")
        return _in_order(self.keys, given), _in_order(self.args, given)

    def __call__(self, conn: redis.Redis, **given: Any) -> Any:
        """Run on ``conn`` with KEYS and ARGV given by name."""
        keys, args = self.flatten(given)
        try:
            return self.script(keys, args, client=conn)
        except redis.exceptions.NoScriptError:  # flushed again between its load and its run
            return conn.eval(self.source, len(keys), *keys, *args)


def _in_order(params: tuple[Param, ...], given: dict[str, Any]) -> list[Any]:
    values: list[Any] = []
    for p in params:
        if p.rest:
            values.extend(given[p.ident])
        else:
            values.append(given[p.ident])
    return values


State = TypeVar("State", bound=enum.Enum)


def lua_moves(moves: Mapping[State, Iterable[State]]) -> str:
    """A table of allowed moves between states as a Lua table literal, by the states'
    values: ``{queued = {running = true, ...}, ...}`` (MOVES[from][to] is true or nil)."""
    rows = []
    for src, dsts in moves.items():
        allowed = ", ".join(f"{dst.value} = true" for dst in sorted(dsts, key=_value))
        rows.append(f"{src.value} = {{{allowed}}}")
    return "{" + ", ".join(rows) + "}"


def _value(state: enum.Enum) -> Any:
    return state.value


# Ack entries and delete them (an acked entry left in the stream would grow it forever).
ACK_AND_DELETE = """
local function ack_and_delete(stream, group, ids)
  for i = 1, #ids, 500 do
    local chunk = {}
    for k = i, math.min(i + 499, #ids) do chunk[#chunk + 1] = ids[k] end
    redis.call('XACK', stream, group, unpack(chunk))
    redis.call('XDEL', stream, unpack(chunk))
  end
end
"""
