"""Every ``BATCHGEN_*`` variable has one home, jobs/environment.py: no other module reads
one, docs/commands.md's Environment table lists each, and a bad value is one line that
names the variable."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from batchgen.jobs.crashpoints import CrashPlan
from batchgen.jobs.environment import CACHE_MAX_BYTES, VARIABLES
from batchgen.jobs.intake.validate import PARALLEL_MIN_BYTES, procs_for
from batchgen.jobs.ops.finalize.finalization import FinalizeSettings
from batchgen.jobs.ops.retention import default as default_retention
from batchgen.jobs.redis.keys import prefix_from_env
from batchgen.jobs.schema.errors import UsageError
from batchgen.serve.settings import keys_from_env
from tests.doc_blocks import REPO

HOME = REPO / "jobs" / "environment.py"
NAME = re.compile(r"BATCHGEN_[A-Z0-9_]*")


def environment_reads(tree: ast.AST) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(the read, the name it reads) for each read of the environment: ``os.environ``
    (``.get``, ``[...]``, ``in``), ``os.getenv`` and click's ``envvar=``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            if ast.unparse(node.func).endswith(("environ.get", "environ.pop", "getenv")):
                yield from ((node, arg) for arg in node.args[:1])
            yield from ((node, k.value) for k in node.keywords if k.arg == "envvar")
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            yield node, node.slice
        elif isinstance(node, ast.Compare) and any(
            ast.unparse(c).endswith("environ") for c in node.comparators
        ):
            yield node, node.left


def reads_outside_the_home() -> list[str]:
    """Each string that is a variable's name (or its start: f"BATCHGEN_X_{y}"), and each
    read of the environment for one (a name, or a declared variable's ``.name``), in
    any module but the home."""
    found = []
    for root in ("batchgen", "jobs", "worker", "kernels"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == HOME:
                continue
            where = path.relative_to(REPO)
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and NAME.fullmatch(str(node.value).strip()):
                    found.append(f"{where}:{node.lineno}: {node.value!r}")
            for read, name in environment_reads(tree):
                text = ast.unparse(name)
                if NAME.search(text) or text.endswith(".name"):
                    found.append(f"{where}:{getattr(read, 'lineno', 0)}: {ast.unparse(read)}")
    return found


def test_no_module_but_the_home_reads_or_names_a_batchgen_variable():
    assert reads_outside_the_home() == []


def test_every_variable_is_declared_once_with_a_one_line_meaning():
    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names)) == 22
    for variable in VARIABLES:
        assert NAME.fullmatch(variable.name)
        assert variable.meaning.strip() and "\n" not in variable.meaning, variable.name
    source = HOME.read_text()
    assert sorted(set(NAME.findall(source)) - {"BATCHGEN_"}) == sorted(names)


def environment_table() -> list[str]:
    text = (REPO / "docs" / "commands.md").read_text()
    section = text.split("\n## Environment\n", 1)[1].split("\n## ", 1)[0]
    first_cells = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    return [name for cell in first_cells for name in NAME.findall(cell)]


def test_the_docs_environment_table_lists_every_declared_variable_once():
    listed = environment_table()
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(v.name for v in VARIABLES)


def test_the_defaults_are_what_they_were(monkeypatch):
    for variable in VARIABLES:
        monkeypatch.delenv(variable.name, raising=False)
    assert FinalizeSettings.from_env() == FinalizeSettings(30.0, 2.0, 300.0, 256 << 20)
    assert default_retention() == 7 * 86400
    assert prefix_from_env() == "bg"
    assert CACHE_MAX_BYTES.get() == 10 << 30
    assert keys_from_env(()) == []
    assert CrashPlan.from_env().point is None
    assert procs_for(PARALLEL_MIN_BYTES) == min(os.cpu_count() or 1, 8)
    monkeypatch.setenv("BATCHGEN_PREFIX", "")  # kept as given, as before
    assert prefix_from_env() == ""
    monkeypatch.setenv("BATCHGEN_FINALIZE_RETRY_S", "")  # empty: unset
    assert FinalizeSettings.from_env().retry_s == 2.0


def test_set_values_reach_their_readers(monkeypatch):
    monkeypatch.setenv("BATCHGEN_FINALIZE_LEASE_S", "1.5")
    monkeypatch.setenv("BATCHGEN_FINALIZE_WINDOW_BYTES", "1e6")
    monkeypatch.setenv("BATCHGEN_CACHE_MAX_BYTES", "500M")
    monkeypatch.setenv("BATCHGEN_API_KEYS", " k1, ,k2 ")
    monkeypatch.setenv("BATCHGEN_SUBMIT_PROCS", "0")
    monkeypatch.setenv("BATCHGEN_TEST_CRASH_AT", "after_publish:3:stop")
    settings = FinalizeSettings.from_env()
    assert (settings.lease_s, settings.window_bytes) == (1.5, 1_000_000)
    assert CACHE_MAX_BYTES.get() == 500 << 20
    assert keys_from_env(()) == ["k1", "k2"]
    assert procs_for(PARALLEL_MIN_BYTES) == 1  # at least one, as before
    plan = CrashPlan.from_env()
    assert (plan.point, plan.on_hit, plan.stop) == ("after_publish", 3, True)


@pytest.mark.parametrize(
    ("name", "value", "read", "message"),
    [
        ("BATCHGEN_FINALIZE_RETRY_S", "abc", FinalizeSettings.from_env,
         "BATCHGEN_FINALIZE_RETRY_S='abc': give a number of seconds, 0 or more"),
        ("BATCHGEN_FINALIZE_LEASE_S", "-1", FinalizeSettings.from_env,
         "BATCHGEN_FINALIZE_LEASE_S='-1': give a number of seconds, 0 or more"),
        ("BATCHGEN_FINALIZE_WINDOW_BYTES", "lots", FinalizeSettings.from_env,
         "BATCHGEN_FINALIZE_WINDOW_BYTES='lots': give a number of bytes, 0 or more"),
        ("BATCHGEN_SUBMIT_PROCS", "four", lambda: procs_for(PARALLEL_MIN_BYTES),
         "BATCHGEN_SUBMIT_PROCS='four': give a whole number"),
        ("BATCHGEN_CACHE_MAX_BYTES", "10 gigs", CACHE_MAX_BYTES.get,
         "BATCHGEN_CACHE_MAX_BYTES='10 gigs': give a size like 500M, 10G or 1048576"),
        ("BATCHGEN_TEST_CRASH_AT", "after_publish:x", CrashPlan.from_env,
         "BATCHGEN_TEST_CRASH_AT='after_publish:x': N in NAME:N must be a whole number "
         "(the N-th hit)"),
        ("BATCHGEN_TEST_CRASH_AT", "after_publish:1:boom", CrashPlan.from_env,
         "BATCHGEN_TEST_CRASH_AT='after_publish:1:boom': the action after NAME:N must be "
         "'stop' or 'exit'"),
        ("BATCHGEN_RETENTION", "forever", default_retention,
         "BATCHGEN_RETENTION 'forever': give a duration like 7d, 36h, 90m or 3600 (seconds)"),
    ],
)  # fmt: skip
def test_a_bad_value_is_a_usage_error_naming_the_variable(monkeypatch, name, value, read, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as raised:
        read()
    assert str(raised.value) == message


@pytest.mark.parametrize(
    ("args", "name", "value", "hint"),
    [
        (["status"], "BATCHGEN_REDIS_WAIT", "abc", "give a number of seconds, 0 or more"),
        # the worker's finalizer reads it later, in a process of its own: checked at start
        (["worker", "--model", "./none"], "BATCHGEN_FINALIZE_RETRY_CAP_S", "5min",
         "give a number of seconds, 0 or more"),
        (["worker", "--model", "./none"], "BATCHGEN_CACHE_MAX_BYTES", "big",
         "give a size like 500M, 10G or 1048576"),
    ],
)  # fmt: skip
def test_the_cli_says_a_bad_value_in_one_line(args, name, value, hint):
    env = {**os.environ, "BATCHGEN_REDIS_URL": "redis://127.0.0.1:1/0", name: value}
    out = subprocess.run([sys.executable, "-m", "batchgen", *args], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == f"batchgen: error: {name}={value!r}: {hint}\n"
