"""Lua scripts people can read: named KEYS and ARGV, a header, registered once per connection.

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

A script's SHA is computed once, when it is defined; calls are EVALSHA, and a
server that does not know the script yet (new, restarted) gets it loaded once
(SCRIPT LOAD) on the NOSCRIPT reply.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
from redis.exceptions import NoScriptError

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
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "source", self._render())
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())

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

    def flatten(self, given: dict[str, Any]) -> tuple[list[Value], list[Value]]:
        """(keys, args) in declared order from keyword values; a rest name takes a list."""
        missing = [p.ident for p in (*self.keys, *self.args) if p.ident not in given]
        extra = set(given) - {p.ident for p in (*self.keys, *self.args)}
        if missing or extra:
            raise TypeError(f"script {self.name}: missing {missing}, unexpected {sorted(extra)}")
        out: tuple[list[Value], list[Value]] = ([], [])
        for params, values in ((self.keys, out[0]), (self.args, out[1])):
            for p in params:
                if p.rest:
                    values.extend(given[p.ident])
                else:
                    values.append(given[p.ident])
        return out

    def __call__(self, conn: redis.Redis, **given: Any) -> Any:
        """Run on ``conn`` with KEYS and ARGV given by name."""
        keys, args = self.flatten(given)
        try:
            return conn.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a new or restarted server: load it once, then run it
            self.load(conn)
            return conn.evalsha(self.sha, len(keys), *keys, *args)

    def load(self, conn: redis.Redis) -> str:
        """Load the script into the server (its SHA is fixed by the source)."""
        sha = conn.script_load(self.source)
        assert sha == self.sha, (sha, self.sha)
        return self.sha


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
