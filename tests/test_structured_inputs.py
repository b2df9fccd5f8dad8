"""Structured output in request lines, job defaults and submit: forms, errors, compile once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.intake.lines import LineError
from batchgen.jobs.ops.fair_share import backlog
from batchgen.jobs.ops.submission import submit
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.schema import constraints
from batchgen.jobs.schema.errors import InvalidInput
from batchgen.jobs.schema.sampling import DEFAULTS, job_defaults
from tests.doc_blocks import doc_block

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OPENAI_SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}


def _entry(line: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    out = parse_line(1, json.dumps(line).encode(), defaults or DEFAULTS)
    assert not isinstance(out, LineError), str(out)
    return json.loads(out)


def _error(line: dict[str, Any] | str, defaults: dict[str, Any] | None = None) -> str:
    raw = line if isinstance(line, str) else json.dumps(line)
    out = parse_line(7, raw.encode(), defaults or DEFAULTS)
    assert isinstance(out, LineError), out
    return str(out)


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": messages, **body}}  # fmt: skip


@pytest.mark.parametrize(
    ("given", "spec"),
    [
        ({"structured_output": {"json": SCHEMA}}, {"json": SCHEMA}),
        ({"structured_output": {"json_object": True}}, {"json_object": True}),
        ({"structured_output": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"structured_output": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
        ({"structured_output": {"grammar": 'start: "x"'}}, {"grammar": 'start: "x"'}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": OPENAI_SCHEMA_FORMAT}, {"json": SCHEMA}),
        ({"response_format": {"type": "text"}}, None),
        ({}, None),
    ],
)
def test_native_lines_carry_one_constraint(given, spec):
    entry = _entry({"prompt": "x", **given})
    assert (
        entry["s"]["structured_output"] == spec if given else "structured_output" not in entry["s"]
    )


def test_openai_body_response_format_is_the_same_constraint():
    assert _entry(_chat({"response_format": OPENAI_SCHEMA_FORMAT}))["s"]["structured_output"] == {
        "json": SCHEMA
    }
    assert _entry(_chat({"response_format": {"type": "json_object"}}))["s"][
        "structured_output"
    ] == {"json_object": True}


def test_a_line_overrides_the_job_default_and_text_turns_it_off():
    defaults = job_defaults({"structured_output": {"choice": ["a", "b"]}})
    assert _entry({"prompt": "x"}, defaults)["s"]["structured_output"] == {"choice": ["a", "b"]}
    own = _entry({"prompt": "x", "structured_output": {"regex": "z+"}}, defaults)
    assert own["s"]["structured_output"] == {"regex": "z+"}
    off = _entry({"prompt": "x", "response_format": {"type": "text"}}, defaults)
    assert off["s"]["structured_output"] is None
    assert (
        _entry({"prompt": "x", "structured_output": None}, defaults)["s"]["structured_output"]
        is None
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "x", "structured_output": {"json": [1]}},
         "line 7, column 38: structured_output: json must be a JSON Schema object, got [1]"),
        ({"prompt": "x", "structured_output": {"json": {"type": "frob"}}},
         "line 7, column 38: structured_output: json does not compile: Invalid type: frob"),
        ({"prompt": "x", "structured_output": {"regex": "a(b"}},
         "structured_output: regex does not compile: invalid regex"),
        ({"prompt": "x", "structured_output": {"grammar": "start: foo"}},
         'structured_output: grammar does not compile: at 1(8): unknown name: "foo"'),
        ({"prompt": "x", "structured_output": {"choice": []}},
         "structured_output: choice must be a non-empty list of strings, got []"),
        ({"prompt": "x", "structured_output": {"choice": ["a", "a"]}},
         "structured_output: choice lists a string twice"),
        ({"prompt": "x", "structured_output": {"json_object": False}},
         "structured_output: json_object must be true, got false"),
        ({"prompt": "x", "structured_output": {"regex": "a", "choice": ["a"]}},
         "structured_output: must be an object with exactly one of json, json_object, regex"),
        ({"prompt": "x", "structured_output": {"schema": {}}},
         "structured_output: must be an object with exactly one of"),
        ({"prompt": "x", "response_format": {"type": "xml"}},
         'response_format.type must be "text", "json_object" or "json_schema", got "xml"'),
        ({"prompt": "x", "response_format": {"type": "json_schema"}},
         "response_format.json_schema must be"),
        ({"prompt": "x", "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "n", "schema": {"type": "frob"}}}},
         "response_format.json_schema.schema: json does not compile: Invalid type: frob"),
        ({"prompt": "x", "response_format": {"type": "json_object"}, "structured_output": {"regex": "a"}},
         "give response_format or structured_output, not both"),
        ({"prompt": "x", "structured_output": {"regex": "a"}, "stop": "x"},
         "line 7, column 38: stop cannot be combined with structured_output"),
        (_chat({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "x": 1}}}),
         "response_format.json_schema has unknown field 'x'"),
    ],
)  # fmt: skip
def test_bad_constraints_name_line_column_and_reason(line, message):
    assert message in _error(line)


def test_a_job_default_stop_conflicts_with_a_line_constraint():
    defaults = job_defaults({"stop": ("END",)})
    assert "stop cannot be combined with structured_output" in _error(
        {"prompt": "x", "structured_output": {"regex": "a+"}}, defaults
    )


def test_each_distinct_constraint_compiles_once(monkeypatch):
    calls: list[str] = []
    real = constraints.grammar_text

    def counted(spec: dict[str, Any]) -> str:
        calls.append("x")
        return real(spec)

    monkeypatch.setattr(constraints, "grammar_text", counted)
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "boolean"}}}
    for i in range(50):
        _entry({"prompt": f"p{i}", "structured_output": {"json": schema}})
    _entry({"prompt": "x", "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "n", "schema": schema}}})  # fmt: skip
    assert len(calls) == 1


def test_validation_stays_torch_free(tmp_path: Path):
    code = (
        "import sys, json\n"
        "from batchgen.jobs.intake.inputs import parse_line\n"
        "from batchgen.jobs.schema.sampling import DEFAULTS\n"
        "line = json.dumps({'prompt': 'x', 'structured_output': {'json': {'type': 'object'}}})\n"
        "assert not isinstance(parse_line(1, line.encode(), DEFAULTS), Exception)\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_submit_refuses_an_invalid_schema_on_line_n_and_queues_nothing(redis_url, tmp_path):
    conn: Any = redis.Redis.from_url(redis_url)
    conn.flushdb()
    lines = [{"prompt": "a", "structured_output": {"json": SCHEMA}}] * 2 + [
        {"prompt": "b", "structured_output": {"json": {"type": "object", "minProperties": "x"}}}
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(InvalidInput) as info:
        submit(conn, Keys("bg"), source_path=str(path), model="m", defaults=dict(DEFAULTS),
               job_id="bad-schema", output=str(tmp_path / "out"))  # fmt: skip
    assert "1 invalid line(s); nothing was enqueued" in str(info.value)
    assert "  line 3, column 38: structured_output: json does not compile" in str(info.value)
    assert conn.dbsize() == 0


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchgen", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def test_cli_flags_set_the_job_default_and_refuse_bad_ones(redis_url, tmp_path):
    import os

    env = {**os.environ, "BATCHGEN_REDIS_URL": redis_url}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        '{"prompt": "a"}\n{"prompt": "b", "structured_output": {"regex": "[0-9]+"}}\n'
    )
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = _cli("submit", str(prompts), "--model", "m", "--json-schema", str(schema), "--job-id",
               "flags", "--output", str(tmp_path / "o"), env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    conn: Any = redis.Redis.from_url(redis_url)
    qk = Keys.from_env().queue_for_model("m")
    entries = [json.loads(r) for _, _, r in backlog.queued(conn, qk, "flags")]
    assert [e["s"]["structured_output"] for e in entries] == [{"json": SCHEMA}, {"regex": "[0-9]+"}]

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (("--json-schema", str(bad)), f"--json-schema {bad}: not valid JSON"),
        (("--regex", "a("), "--regex: regex does not compile"),
        (("--regex", "a", "--choice", "x"), "--regex and --choice: give at most one output constraint"),
        (("--choice", "x", "--stop", "y"), "stop cannot be combined with structured_output"),
        (("--grammar", str(bad)), "--grammar: grammar does not compile"),
    ]  # fmt: skip
    for flags, message in cases:
        out = _cli("submit", str(prompts), "--model", "m", *flags, env=env)
        assert out.returncode == 2 and message in out.stderr, (flags, out.stderr)
        assert "Traceback" not in out.stderr


def test_the_docs_examples_are_accepted_as_written():
    lines = doc_block("structured-lines").text.strip().splitlines()
    kinds = [next(iter(_entry(json.loads(line))["s"]["structured_output"])) for line in lines]
    assert kinds == ["json", "json_object", "regex", "choice", "grammar", "json"]
    grammar = doc_block("structured-grammar").text
    assert grammar.startswith("start:")
    assert constraints.check_spec({"grammar": grammar}) == {"grammar": grammar}
