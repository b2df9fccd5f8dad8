"""The job lifecycle's one home: states from the enum, named KEYS/ARGV, moves the table allows."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import pytest
import redis

import batchgen.jobs
import batchgen.worker.consumer
from batchgen.jobs.ops.lifecycle import MOVES, JobState, script
from batchgen.jobs.redis.lua import LuaScript


def all_scripts() -> list[LuaScript]:
    """Every script of the jobs part and of the worker's side of the queue."""
    found: dict[str, LuaScript] = {}
    for package in (batchgen.jobs, batchgen.worker.consumer):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for value in vars(module).values():
                if isinstance(value, LuaScript):
                    found[value.name] = value
    return list(found.values())


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url, decode_responses=True)


def test_every_script_is_found_and_named_uniquely() -> None:
    names = [s.name for s in all_scripts()]
    assert len(names) == len(set(names))
    assert {"commit parts", "cancel job", "create job", "finish job", "append chunk"} <= set(names)


@pytest.mark.parametrize("lua", all_scripts(), ids=lambda s: s.name)
def test_no_script_spells_a_state_name_or_counts_offsets(lua: LuaScript) -> None:
    body = lua.body
    for state in JobState:
        assert f"'{state.value}'" not in body and f'"{state.value}"' not in body, state
    # KEYS/ARGV are bound to names in the generated header, never indexed in a body
    assert "KEYS[" not in body and "ARGV[" not in body
    header = lua.source.splitlines()
    declared = [line for line in header if line.startswith(("-- KEYS[", "-- ARGV["))]
    assert len(declared) == len(lua.keys) + len(lua.args)


def test_the_header_names_each_key_and_argument_in_order() -> None:
    lua = LuaScript.define(
        "demo", keys=[("job", "the record"), "*rest"], args=["a", ("b", "why")], body="return a"
    )
    assert lua.source.splitlines()[:5] == [
        "-- batchgen: demo",
        "-- KEYS[1] job: the record",
        "-- KEYS[2..] rest",
        "-- ARGV[1] a",
        "-- ARGV[2] b: why",
    ]
    assert lua.flatten({"job": "k", "rest": ["x", "y"], "a": 1, "b": 2}) == (
        ["k", "x", "y"],
        [1, 2],
    )
    with pytest.raises(TypeError, match="missing \\['b'\\]"):
        lua.flatten({"job": "k", "rest": [], "a": 1})


def test_rest_arguments_arrive_as_a_list_even_when_long(redis_url: str) -> None:
    lua = LuaScript.define("count", keys=["k"], args=["*items"], body="return #items")
    # 20k values: unpack() of that many would overflow Lua's C stack
    assert lua(rconn(redis_url), k="x", items=list(range(20_000))) == 20_000


INCR = LuaScript.define("incr", keys=["counter"], args=["by"],
                        body="return redis.call('INCRBY', counter, by)")  # fmt: skip


def test_a_script_runs_once_after_the_server_forgot_it(redis_url: str) -> None:
    conn = rconn(redis_url)
    assert INCR(conn, counter="n", by=1) == 1
    conn.script_flush()  # a restarted server (or a promoted replica) knows no script
    assert INCR(conn, counter="n", by=10) == 11  # run exactly once: not 21, no error
    assert conn.get("n") == "11"


class FlushingAfterLoad(redis.Redis):
    """A client whose SCRIPT LOAD a SCRIPT FLUSH follows at once (as another client's may)."""

    def script_load(self, script: Any) -> Any:
        sha = super().script_load(script)
        self.script_flush()
        return sha


def test_a_script_flushed_between_its_load_and_its_run_runs_once(redis_url: str) -> None:
    conn: Any = FlushingAfterLoad.from_url(redis_url, decode_responses=True)
    conn.script_flush()
    assert INCR(conn, counter="n", by=3) == 3  # NOSCRIPT twice: sent as source (EVAL)
    assert conn.get("n") == "3"


def test_steady_state_calls_are_evalsha_and_the_source_is_sent_once(redis_url: str) -> None:
    conn = rconn(redis_url)
    conn.script_flush()
    conn.config_resetstat()
    assert [INCR(conn, counter="n", by=1) for _ in range(5)] == [1, 2, 3, 4, 5]
    stats = conn.info("commandstats")
    assert "cmdstat_eval" not in stats  # the source never travels with a call
    loads = stats.get("cmdstat_script|load") or stats["cmdstat_script"]  # Redis 7 / 6.2
    assert loads["calls"] == 1
    assert stats["cmdstat_evalsha"]["calls"] == 6  # the NOSCRIPT reply, then five runs


def test_a_script_in_a_transaction_runs_after_the_server_forgot_it(redis_url: str) -> None:
    conn = rconn(redis_url)
    conn.script_flush()
    pipe = conn.pipeline(transaction=True)
    INCR(pipe, counter="n", by=1)
    INCR(pipe, counter="n", by=10)
    assert pipe.execute() == [1, 11]


MOVE = script(
    "test move",
    keys=["job"],
    args=["to"],
    body="""
move(job, redis.call('HGET', job, 'state'), to, 'touched', '1')
return redis.call('HGET', job, 'state')
""",
)


@pytest.mark.parametrize("src", list(JobState), ids=lambda s: s.value)
def test_lua_moves_follow_the_python_table(redis_url: str, src: JobState) -> None:
    conn = rconn(redis_url)
    for dst in JobState:
        conn.delete("job")
        conn.hset("job", "state", src.value)
        if dst in MOVES[src]:
            assert MOVE(conn, job="job", to=dst.value) == dst.value
        else:
            with pytest.raises(redis.ResponseError, match=f"cannot move from {src.value} to"):
                MOVE(conn, job="job", to=dst.value)
            assert conn.hgetall("job") == {"state": src.value}  # refused before any write
