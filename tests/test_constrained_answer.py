"""Constrained output on a Qwen-shaped toy: with a reasoning parser the constraint (a
forced tool call's too) starts after the reasoning, as vLLM's does, and a regex that
holds the text of an added token that is not special (``<tool_call>``) runs.

The toy's weights are random: its free text is never JSON, so an answer that validates
after free reasoning shows the constraint started at the end tag and not before.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchgen.jobs.schema.reasoning import parser
from tests.cli_session import Shell, rows, write_jsonl
from tests.tool_models import ASK, NAMED, QWEN_TEMPLATE, SCHEMAS, TOOLS, write_chat_model

ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # Qwen3's, not special
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """A toy qwen3 whose tokenizer has Qwen3's think and tool-call tags as added (not
    special) tokens inside the embedding table, and Qwen's (hermes) chat template."""
    return write_chat_model(tmp_path_factory.mktemp("qwen3-answer"), "qwen3", ADDED, QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def engine(qwen3_model):
    from batchgen import Engine

    return Engine.from_pretrained(qwen3_model, num_kv_blocks=64, device="cpu")


def _run(engine, requests: dict[str, tuple[list[int], Any, dict[str, Any]]]) -> dict[str, Any]:
    for rid, (prompt, params, kwargs) in requests.items():
        engine.add_request(rid, prompt, params, **kwargs)
    outs: dict[str, Any] = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


def _greedy(bias: dict[int, float], max_tokens: int = 60, **more: Any) -> Any:
    from batchgen import SamplingParams, StructuredOutput

    return SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=bias or None,
                          structured_output=StructuredOutput(json=SCHEMA), **more)  # fmt: skip


def test_the_constraint_starts_after_the_reasoning_in_the_engine(engine):
    end = engine.tokenizer.convert_tokens_to_ids("</think>")
    prompt = engine.encode(CHAT)
    qwen3 = {"reasoning": parser("qwen3")}
    outs = _run(engine, {
        "free": (prompt, _greedy({}), qwen3),  # never ends its reasoning: never constrained
        "thinks": (prompt, _greedy({end: 4.5}), qwen3),  # the end tag comes at token 27
        "at once": (prompt, _greedy({end: 8}), qwen3),  # the end tag first
        "plain": (prompt, _greedy({end: 4.5}), {}),  # no parser: constrained from token 1
    })  # fmt: skip
    free, thinks = outs["free"], outs["thinks"]
    assert (free.finish_reason, len(free.token_ids), end in free.token_ids) == ("length", 60, False)
    assert not free.text.lstrip().startswith("{")
    assert thinks.finish_reason == "stop" and thinks.token_ids.index(end) == 27
    reasoning, answer = thinks.text.split("</think>")
    assert reasoning.startswith(engine.decode(free.token_ids[:5]))  # free text, as unbiased
    assert not reasoning.lstrip().startswith("{") and len(reasoning) > 27
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert answer == engine.decode(thinks.token_ids[28:])
    first, rest = outs["at once"].text.split("</think>")
    assert first == "" and jsonschema.validate(json.loads(rest), SCHEMA) is None
    plain = outs["plain"]
    assert (
        end not in plain.token_ids and jsonschema.validate(json.loads(plain.text), SCHEMA) is None
    )


def test_a_resumed_request_finds_its_reasoning_ended_or_not(engine):
    end = engine.tokenizer.convert_tokens_to_ids("</think>")
    prompt = engine.encode(CHAT)
    whole = _run(engine, {"whole": (prompt, _greedy({end: 4.5}), {"reasoning": parser("qwen3")})})
    tokens = list(whole["whole"].token_ids)
    assert tokens.index(end) == 27 and whole["whole"].finish_reason == "stop"
    resumed = _run(engine, {
        f"from {cut}": (prompt, _greedy({end: 4.5}),
                        {"reasoning": parser("qwen3"), "resume_token_ids": tokens[:cut]})
        for cut in (10, 28, 31)  # inside the reasoning, right after its end, in the answer
    })  # fmt: skip
    assert {rid: list(o.token_ids) for rid, o in resumed.items()} == {
        "from 10": tokens, "from 28": tokens, "from 31": tokens}  # fmt: skip


@pytest.mark.parametrize(
    "spec, reasoned",
    [
        ("think:<r>,</r>", 'I pick a.</r>{"a":'),  # text tags, the answer begun
        ("gpt_oss", "<|channel|>analysis<|message|>Pick a.<|end|><|start|>assistant"
                    '<|channel|>final<|message|>{"a"'),  # harmony: after the final start
    ],
)  # fmt: skip
def test_a_resumed_answer_goes_on_under_the_constraint(engine, spec, reasoned):
    resumed = engine.tokenizer.encode(reasoned, add_special_tokens=False)
    out = _run(engine, {spec: (engine.encode(CHAT), _greedy({}, len(resumed) + 40),
                               {"reasoning": parser(spec), "resume_token_ids": resumed})})  # fmt: skip
    text = out[spec].text
    marker = parser(spec).answer_marker
    assert out[spec].finish_reason == "stop" and text.startswith(reasoned)
    jsonschema.validate(json.loads(text[text.index(marker) + len(marker) :]), SCHEMA)


def test_a_regex_holding_an_added_tokens_text_runs(engine):
    from batchgen import SamplingParams, StructuredOutput

    tool_call = engine.tokenizer.convert_tokens_to_ids("<tool_call>")
    pattern = "<tool_call>[a-z]{1,5}</tool_call>"
    params = SamplingParams(max_tokens=30, temperature=0,
                            structured_output=StructuredOutput(regex=pattern))  # fmt: skip
    out = _run(engine, {"r": (engine.encode(CHAT), params, {})})["r"]
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out
    assert out.token_ids[0] == tool_call  # the added token wrote its own text


def test_forced_calls_and_schemas_after_reasoning_through_the_cli(
    qwen3_model, tmp_path, private_redis
):
    from transformers import AutoTokenizer

    end_id = AutoTokenizer.from_pretrained(str(qwen3_model)).convert_tokens_to_ids("</think>")
    (tmp_path / "qwen3").symlink_to(qwen3_model)
    lines: list[dict[str, Any]] = []
    for bias in (3, 4, 4.5, 5):
        steer = {"temperature": 0, "logit_bias": {str(end_id): bias}}
        lines += [
            {"id": f"json{bias}", "messages": CHAT, "max_tokens": 80,
             "structured_output": {"json": SCHEMA}, **steer},
            {"id": f"req{bias}", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
             "max_tokens": 160, **steer},
            {"id": f"named{bias}", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED,
             "max_tokens": 80, **steer},
        ]  # fmt: skip
    lines.append({"id": "cut", "messages": CHAT, "max_tokens": 6, "temperature": 0,
                  "structured_output": {"json": SCHEMA}})  # fmt: skip
    write_jsonl(tmp_path / "p.jsonl", lines)
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    out = shell.run("run", "p.jsonl", "--model", "qwen3", "-o", "out.parquet", "--job-id",
                    "answer", "--device", "cpu", "--reasoning-parser", "qwen3",
                    "--job-output", str(tmp_path / "job"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = rows(tmp_path / "out.parquet")
    by_id = {row_id: {k: got[k][i] for k in got} for i, row_id in enumerate(got["id"])}
    thought = set()
    for row_id, row in by_id.items():
        ended = end_id in row["token_ids"]
        if row_id == "cut" or not ended:  # max_tokens ran out while it reasoned
            assert (row["finish_reason"], row["text"], row["tool_calls"]) == ("length", "", None)
            assert row["reasoning_tokens"] == len(row["token_ids"]) and row["error"] is None
            continue
        if row["reasoning"]:
            thought.add(re.sub(r"[\d.]", "", row_id))
            assert not row["reasoning"].lstrip().startswith(("{", "["))  # free text
        assert row["reasoning_tokens"] == row["token_ids"].index(end_id) + 1
        if row_id.startswith("json"):
            assert row["finish_reason"] == "stop"
            jsonschema.validate(json.loads(row["text"]), SCHEMA)
            continue
        assert (row["finish_reason"], row["text"], row["error"]) == ("tool_calls", "", None)
        calls = row["tool_calls"]
        assert calls and all(c["function"]["name"] in SCHEMAS for c in calls)
        assert row_id.startswith("req") or [c["function"]["name"] for c in calls] == ["get_time"]
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])  # fmt: skip
    assert thought == {"json", "req", "named"}  # each kind reasoned freely, then answered
    assert sorted(i for i, row in by_id.items() if end_id not in row["token_ids"]) == [
        "cut", "json3", "named3"]  # fmt: skip
