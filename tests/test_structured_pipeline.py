"""Structured output end to end: submit -> a real worker process -> Parquet.

Both line formats and the --json-schema job default; every stopped row parses and
validates, the ``structured`` column names the constraint, and the tokens equal
``Engine.generate`` with the same constraint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow.parquet as pq
import pytest

from tests.test_pipeline_e2e import batchgen, download, submit, write_jsonl
from tests.test_pipeline_e2e import env as env  # fixtures
from tests.test_pipeline_e2e import workers as workers

DEFAULT_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}
LINE_SCHEMA = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 5},
                             "minItems": 1, "maxItems": 2}},
    "required": ["words"],
    "additionalProperties": False,
}  # fmt: skip


def _lines() -> list[dict[str, Any]]:
    chat = [{"role": "user", "content": "Classify this mail."}]
    return [
        {"id": "default", "prompt": "Mail one: win a prize", "max_tokens": 60},
        {"id": "native-json", "prompt": "List words", "max_tokens": 60,
         "structured_output": {"json": LINE_SCHEMA}},
        {"id": "native-rf", "prompt": "List words", "max_tokens": 60, "temperature": 1.0,
         "seed": 4, "response_format": {"type": "json_schema",
                                        "json_schema": {"name": "w", "schema": LINE_SCHEMA}}},
        {"id": "choice", "prompt": "yes or no?", "max_tokens": 20,
         "structured_output": {"choice": ["yes", "no"]}},
        {"id": "free", "prompt": "Mail two", "max_tokens": 12, "response_format": {"type": "text"}},
        {"custom_id": "openai-chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "toy", "messages": chat, "max_completion_tokens": 60,
                  "response_format": {"type": "json_schema",
                                      "json_schema": {"name": "w", "schema": LINE_SCHEMA,
                                                      "strict": True}}}},
        {"custom_id": "openai-default", "method": "POST", "url": "/v1/completions",
         "body": {"model": "toy", "prompt": "Mail three", "max_tokens": 60}},
        {"custom_id": "openai-regex", "method": "POST", "url": "/v1/completions",
         "body": {"model": "toy", "prompt": "A code:", "max_tokens": 20,
                  "structured_output": {"regex": "[A-Z]{2}[0-9]{2}"}}},
    ]  # fmt: skip


EXPECTED = {  # id -> (structured column, schema or check)
    "default": ("json", DEFAULT_SCHEMA),
    "native-json": ("json", LINE_SCHEMA),
    "native-rf": ("json", LINE_SCHEMA),
    "choice": ("choice", None),
    "free": (None, None),
    "openai-chat": ("json", LINE_SCHEMA),
    "openai-default": ("json", DEFAULT_SCHEMA),
    "openai-regex": ("regex", None),
}


@pytest.fixture(scope="module")
def model(toy_model) -> Path:
    return toy_model("llama")


def _reference(model: Path) -> list[list[int]]:
    """The same requests through ``Engine.generate``."""
    from batchgen import Engine, SamplingParams, StructuredOutput

    engine = Engine.from_pretrained(model, device="cpu")
    default = StructuredOutput(json=DEFAULT_SCHEMA)
    line_schema = StructuredOutput(json=LINE_SCHEMA)
    chat = [{"role": "user", "content": "Classify this mail."}]
    requests: list[tuple[Any, SamplingParams]] = [
        ("Mail one: win a prize", SamplingParams(max_tokens=60, structured_output=default)),
        ("List words", SamplingParams(max_tokens=60, structured_output=line_schema)),
        ("List words", SamplingParams(max_tokens=60, temperature=1.0, seed=4,
                                      structured_output=line_schema)),
        ("yes or no?", SamplingParams(max_tokens=20,
                                      structured_output=StructuredOutput(choice=["yes", "no"]))),
        ("Mail two", SamplingParams(max_tokens=12)),
        (chat, SamplingParams(max_tokens=60, structured_output=line_schema)),
        ("Mail three", SamplingParams(max_tokens=60, structured_output=default)),
        ("A code:", SamplingParams(max_tokens=20,
                                   structured_output=StructuredOutput(regex="[A-Z]{2}[0-9]{2}"))),
    ]  # fmt: skip
    outs = engine.generate([p for p, _ in requests], [s for _, s in requests])
    return [list(o.token_ids) for o in outs]


def test_submit_worker_parquet_with_both_formats_and_the_default_schema(
    model,
    workers,
    env,
    tmp_path,
):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(DEFAULT_SCHEMA))
    path = write_jsonl(tmp_path / "p.jsonl", _lines())
    submit(env, model, path, "structured", tmp_path, "--json-schema", str(schema_file))
    proc = workers(model, "--burst", "--max-num-seqs", "4")
    assert proc.wait(timeout=300) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    rows = download(env, "structured", tmp_path)

    assert rows["id"] == list(EXPECTED)
    assert rows["structured"] == [kind for kind, _ in EXPECTED.values()]
    assert rows["token_ids"] == _reference(model)
    for row_id, text, reason in zip(rows["id"], rows["text"], rows["finish_reason"]):
        kind, schema = EXPECTED[row_id]
        if kind is None:
            continue
        assert reason == "stop", (row_id, text)
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)
    assert rows["text"][3] in ("yes", "no")
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", rows["text"][7])


def test_run_on_a_toy_model_gives_valid_json_on_every_stopped_row(
    model,
    env,
    tmp_path,
):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(DEFAULT_SCHEMA))
    lines = [{"prompt": f"Mail {i}", "max_tokens": 40} for i in range(12)]
    out = batchgen(env, "run", str(write_jsonl(tmp_path / "p.jsonl", lines)), "--model",
                   str(model), "-o", str(tmp_path / "run.parquet"), "--device", "cpu",
                   "--json-schema", str(schema_file), "--job-output", str(tmp_path / "job"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = pq.read_table(tmp_path / "run.parquet").to_pydict()
    assert rows["finish_reason"] == ["stop"] * 12
    for text in rows["text"]:
        jsonschema.validate(json.loads(text), DEFAULT_SCHEMA)
    assert rows["structured"] == ["json"] * 12
