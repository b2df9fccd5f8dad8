"""Tool calls: parsers on the real releases' output shapes, tools and tool_choice at
submit, and the tool_calls column through the CLI and serve on a toy checkpoint with
Qwen's tool tokens and its (hermes) chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from batchgen.jobs.schema import tools
from batchgen.jobs.schema.errors import ParserError
from batchgen.jobs.schema.tool_parsers import Call, Extracted, detect, parser
from tests.cli_session import Shell, rows, write_jsonl
from tests.tool_models import (
    ASK,
    NAMED,
    QWEN_TEMPLATE,
    QWEN_TOOL_TOKENS,
    SCHEMAS,
    TIME_PARAMS,
    TOOLS,
    batch_line,
    queue_entry,
    refusal,
    serve_batch,
    write_chat_model,
)

# -- parsers on the releases' output shapes ----------------------------------------------

WEATHER = Call("get_weather", '{"city": "Paris", "days": 3}')
TIME = Call("get_time", '{"zone": "CET"}')


def extract(name: str, text: str) -> Extracted:
    return parser(name).extract(text)


def test_hermes_reads_qwens_tool_call_blocks():
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    assert extract("hermes", one) == Extracted("", [WEATHER])
    # two calls in one output, text before them (Qwen writes a newline between blocks)
    two = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
           '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
           '{"zone": "CET"}}\n</tool_call>')  # fmt: skip
    assert extract("hermes", two) == Extracted("Let me check.\n", [WEATHER, TIME])
    # the model stopped at EOS before the last end tag
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
    assert extract("hermes", cut) == Extracted("", [TIME])
    # arguments given as a JSON string are kept as that text
    stringly = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>'
    assert extract("hermes", stringly) == Extracted("", [TIME])


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",  # no call at all
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
        "<tool_call>\n{'name': 'get_time', 'arguments': {}}\n</tool_call>",  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments no object
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
    ],
)
def test_hermes_keeps_an_output_whose_calls_do_not_parse_as_text(text):
    assert extract("hermes", text) == Extracted(text)


def test_llama3_json_reads_llamas_parameters_objects():
    one = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}'
    assert extract("llama3_json", one) == Extracted("", [WEATHER])
    # <|python_tag|> kept (decoded with special tokens), two calls joined by ";"
    two = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
           '{"name": "get_time", "parameters": {"zone": "CET"}}')  # fmt: skip
    assert extract("llama3_json", two) == Extracted("", [WEATHER, TIME])
    for text in ("The weather is fine.", '{"name": "get_weather", "parameters": {"city": ',
                 '{"name": "get_time", "parameters": {}} and then', '{"no": "name"}'):  # fmt: skip
        assert extract("llama3_json", text) == Extracted(text)


def test_mistral_reads_both_tool_call_formats():
    v3 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
          '{"name": "get_time", "arguments": {"zone": "CET"}}]</s>')  # fmt: skip
    assert extract("mistral", v3) == Extracted("", [WEATHER, TIME])
    v11 = ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
           '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{"zone": "CET"}</s>')  # fmt: skip
    assert extract("mistral", v11) == Extracted("Checking.", [WEATHER, TIME])
    assert extract("mistral", '[TOOL_CALLS]get_time{"zone": "CET"}') == Extracted("", [TIME])
    for text in ("no calls", '[TOOL_CALLS][{"name": "get_time", "arguments": {"zo',
                 "[TOOL_CALLS]get_time[ARGS]not json"):  # fmt: skip
        assert extract("mistral", text) == Extracted(text)
    assert parser("mistral").keeps_special and not parser("hermes").keeps_special


def test_openai_reads_gpt_oss_harmony_messages_to_functions():
    one = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
           "commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"city": "Paris", "days": 3}<|call|>')  # fmt: skip
    assert extract("openai", one) == Extracted("", [WEATHER])
    # two calls, the second with its recipient before the channel
    two = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
           '"Paris", "days": 3}<|call|><|start|>assistant to=functions.get_time<|channel|>'
           'commentary json<|message|>{"zone": "CET"}<|call|>')  # fmt: skip
    assert extract("openai", two) == Extracted("", [WEATHER, TIME])
    final = "<|channel|>final<|message|>It is sunny.<|return|>"
    for text in (
        final,
        '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zo',
    ):
        assert extract("openai", text) == Extracted(text)
    assert parser("openai").keeps_special


def test_a_wrong_parser_name_says_which_exist():
    with pytest.raises(ParserError) as caught:
        parser("qwen")
    assert (
        str(caught.value)
        == "unknown tool-call parser 'qwen': one of hermes, llama3_json, mistral, openai"
    )


def test_detect_reads_the_chat_template():
    assert detect(None) == detect("{{ messages }}") == ""
    assert detect(QWEN_TEMPLATE) == "hermes"
    assert detect("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect("{{ '<|python_tag|>' }}") == "llama3_json"
    assert detect("{{ '<|channel|>commentary to=functions.' + name }}") == "openai"
    assert detect("<tool_call>[TOOL_CALLS]") == ""  # two formats: ambiguous


# -- tools and tool_choice at submit -----------------------------------------------------


def test_tools_reach_the_entry_and_forced_choices_constrain_the_output():
    auto = queue_entry({"messages": ASK, "tools": TOOLS})
    assert (auto["tl"], "tc" in auto, "structured_output" in auto["s"]) == (TOOLS, False, False)
    assert queue_entry(batch_line(ASK, tools=TOOLS, tool_choice="none"))["tc"] == "none"
    named = queue_entry(batch_line(ASK, tools=TOOLS, tool_choice=NAMED))
    assert named["tc"] == NAMED and named["s"]["structured_output"] == {"json": TIME_PARAMS}
    required = queue_entry({"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    schema = required["s"]["structured_output"]["json"]
    assert schema == tools.forced_constraint(TOOLS, "required")["json"]  # type: ignore[index]
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [
        ["get_weather"], ["get_time"]]  # fmt: skip
    assert "maxItems" not in schema
    one = queue_entry(
        batch_line(ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    )
    assert one["s"]["structured_output"]["json"]["maxItems"] == 1


def test_multi_turn_messages_keep_tool_calls_and_tool_results():
    turns: list[dict[str, Any]] = [*ASK,
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "call_1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    entry = queue_entry(batch_line(turns, tools=TOOLS))
    assert entry["m"] == [ASK[0], {**turns[1], "content": ""}, turns[2]]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "hi", "tools": TOOLS},
         "tools needs messages: a prompt is not rendered by the chat template"),
        ({"messages": ASK, "tools": []},
         'tools must be a non-empty list of {"type": "function", "function": {...}} objects'),
        ({"messages": ASK, "tools": [{"type": "function", "function": {"name": "a b"}}]},
         'tools[0].function.name must be 1 to 64 letters, digits, _, ., : or -, got "a b"'),
        ({"messages": ASK, "tools": [TOOLS[0], TOOLS[0]]},
         "tools name the function 'get_weather' twice"),
        ({"messages": ASK, "tool_choice": "required"}, 'tool_choice "required" needs tools'),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": "any"},
         'tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
         '{"name": ...}}, got "any"'),
        ({"messages": ASK, "tools": TOOLS,
          "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
         'tool_choice names the function "get_stock", which tools does not list'),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": "required",
          "response_format": {"type": "json_object"}},
         "tool_choice required constrains the output to a call: give no response_format or "
         "structured_output with it"),
        ({"messages": ASK, "tools": TOOLS, "parallel_tool_calls": "no"},
         'parallel_tool_calls must be true or false, got "no"'),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
         "unknown message field 'tool_calls'"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                          "arguments": {}}}]}]},
         'tool_calls must be a list of {"id", "type": "function", "function": {"name", '
         '"arguments"}} (arguments a JSON string)'),
        (batch_line(ASK, functions=[]), "body.functions is not supported by batchgen"),
    ],
)  # fmt: skip
def test_wrong_tools_are_refused_by_name(line, message):
    assert message in refusal(line)


def test_forced_calls_read_back_the_constrained_output():
    assert tools.forced_calls('{"zone":"CET"}', NAMED) == [Call("get_time", '{"zone": "CET"}')]
    out = '[{"name":"get_weather","parameters":{"city":"Paris","days":3}},{"name":"get_time","parameters":{"zone":"CET"}}]'
    assert tools.forced_calls(out, "required") == [WEATHER, TIME]
    assert tools.forced_calls('[{"name":"get_time","parameters":{"zo', "required") is None
    record = tools.call_record(TIME, "job", 7, 0)
    assert record == {"id": record["id"], "type": "function",
                      "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}  # fmt: skip
    assert record["id"].startswith("call_") and len(record["id"]) == 29
    assert tools.call_record(TIME, "job", 7, 0) == record != tools.call_record(TIME, "job", 7, 1)


# -- a Qwen-shaped toy checkpoint, through the engine, the CLI and serve -----------------


@pytest.fixture(scope="module")
def qwen_model(tmp_path_factory) -> Path:
    """A toy qwen2 with Qwen's tool tokens and Qwen2.5's chat template."""
    return write_chat_model(tmp_path_factory.mktemp("qwen-tools"), "qwen2", QWEN_TOOL_TOKENS,
                            QWEN_TEMPLATE)  # fmt: skip


TURNS: list[dict[str, Any]] = [*ASK,
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]  # fmt: skip


def test_tools_and_tool_turns_render_as_transformers_renders_them(qwen_model):
    from transformers import AutoTokenizer

    from batchgen import Engine

    hf: Any = AutoTokenizer.from_pretrained(str(qwen_model))
    engine = Engine.from_pretrained(qwen_model, num_kv_blocks=64, device="cpu")
    entry = queue_entry({"messages": TURNS, "tools": TOOLS})
    rendered = engine.encode(entry["m"], None, entry["tl"])
    # as vLLM passes them: the arguments string is the object templates write with tojson
    as_objects: list[Any] = [*TURNS[:1], {**TURNS[1], "content": "", "tool_calls": [
        {**TURNS[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                   "arguments": {"city": "Paris", "days": 3}}}]},
                  TURNS[2]]  # fmt: skip
    assert rendered == hf.apply_chat_template(as_objects, tools=TOOLS, add_generation_prompt=True,
                                              tokenize=True, return_dict=False)  # fmt: skip
    text = hf.decode(rendered)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert json.dumps(TOOLS[1]) in text  # the tools, as the template writes them
    assert engine.encode(ASK) == hf.apply_chat_template(ASK, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)  # fmt: skip
    assert detect(hf.chat_template) == "hermes"


# an auto line whose output is steered (by a grammar) into two hermes calls: what a model
# that calls tools writes, so the worker's parser reads real blocks. The added tokens are
# text to the grammar, as to the tokenizer (<tool_call> writes "<tool_call>")
HERMES_GRAMMAR = (r'start: "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": '
                  r'{\"city\": \"" /(Paris|Oslo)/ "\", \"days\": " /[1-9]/ "}}\n</tool_call>'
                  r'\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": '
                  r'\"" /(UTC|CET)/ "\"}}\n</tool_call>"')  # fmt: skip


def _tool_lines() -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for i in range(8):
        sampled = {"temperature": 1.0, "seed": i}
        lines.append({"id": f"req{i}", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                      "max_tokens": 1000, **sampled})  # fmt: skip
        lines.append({"id": f"one{i}", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                      "parallel_tool_calls": False, "max_tokens": 120, **sampled})  # fmt: skip
        lines.append({"id": f"named{i}", "messages": TURNS, "tools": TOOLS,
                      "tool_choice": NAMED, "max_tokens": 60, **sampled})  # fmt: skip
    lines.append({"id": "auto", "messages": ASK, "tools": TOOLS, "max_tokens": 200,
                  "structured_output": {"grammar": HERMES_GRAMMAR}})  # fmt: skip
    lines.append({"id": "prose", "messages": ASK, "tools": TOOLS, "max_tokens": 8})
    lines.append({"id": "pair", "messages": ASK, "tools": TOOLS, "tool_choice": NAMED, "n": 2,
                  "temperature": 1.0, "seed": 3, "max_tokens": 60})  # fmt: skip
    lines.append({"id": "none", "messages": ASK, "tools": TOOLS, "tool_choice": "none",
                  "max_tokens": 200, "structured_output": {"grammar": HERMES_GRAMMAR}})  # fmt: skip
    return lines


def _assert_valid_calls(calls: list[dict[str, Any]], names: list[str]) -> None:
    assert [c["function"]["name"] for c in calls] == names if names else calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])  # fmt: skip


def test_every_forced_row_is_a_valid_call_through_the_cli(qwen_model, tmp_path, private_redis):
    (tmp_path / "qwen").symlink_to(qwen_model)
    write_jsonl(tmp_path / "p.jsonl", _tool_lines())
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    # no --tool-call-parser: the template's <tool_call> chooses hermes
    out = shell.run("run", "p.jsonl", "--model", "qwen", "-o", "out.parquet", "--job-id",
                    "tools", "--device", "cpu", "--job-output", str(tmp_path / "job"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert shell.status("tools")["tool_call_parser"] == "hermes"
    got = rows(tmp_path / "out.parquet")
    by_id = {row_id: {k: got[k][i] for k in got} for i, row_id in enumerate(got["id"])}
    for i in range(8):
        for kind in ("req", "one", "named"):
            row = by_id[f"{kind}{i}"]
            assert (row["finish_reason"], row["text"], row["error"]) == ("tool_calls", "", None)
            calls = row["tool_calls"]
            _assert_valid_calls(calls, ["get_time"] if kind == "named" else [])
            assert len(calls) == 1 if kind != "req" else len(calls) >= 1
            assert row["structured"] == "json"
    assert {c["function"]["name"] for i in range(8) for c in by_id[f"req{i}"]["tool_calls"]} == {
        "get_weather", "get_time"}  # fmt: skip
    auto = by_id["auto"]
    assert auto["finish_reason"] == "tool_calls" and auto["text"] == ""
    _assert_valid_calls(auto["tool_calls"], ["get_weather", "get_time"])
    # tool_choice none: the same output stays text; prose from auto stays text
    assert by_id["none"]["tool_calls"] is None and by_id["none"]["text"].startswith("<tool_call>")
    assert by_id["none"]["finish_reason"] == "stop"
    prose = by_id["prose"]
    assert prose["tool_calls"] is None and prose["finish_reason"] in ("stop", "length")
    # n > 1: each sample is a call of its own, the row's the first sample's
    pair = by_id["pair"]
    samples = pair["choices"]
    assert [(c["index"], c["finish_reason"], c["text"]) for c in samples] == [
        (0, "tool_calls", ""), (1, "tool_calls", "")]  # fmt: skip
    for c in samples:
        _assert_valid_calls(c["tool_calls"], ["get_time"])
    assert samples[0]["tool_calls"] == pair["tool_calls"]
    assert samples[0]["tool_calls"][0]["id"] != samples[1]["tool_calls"][0]["id"]


def test_serve_returns_openai_tool_calls(qwen_model, tmp_path):
    from openai.types.chat import ChatCompletion

    bodies = {
        "req": {"tools": TOOLS, "tool_choice": "required", "max_tokens": 1000, "seed": 1,
                "temperature": 1.0},
        "named": {"tools": TOOLS, "tool_choice": NAMED, "max_tokens": 60},
        "prose": {"tools": TOOLS, "max_tokens": 4},
    }  # fmt: skip
    out, _ = serve_batch(qwen_model, tmp_path, TURNS, bodies)
    assert sorted(out) == ["named", "prose", "req"]
    for cid in ("req", "named"):
        body = out[cid]["response"]["body"]
        choice = ChatCompletion.model_validate(body).choices[0]  # OpenAI's own types
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        calls = [c.model_dump() for c in choice.message.tool_calls]
        _assert_valid_calls(calls, ["get_time"] if cid == "named" else [])
        assert body["choices"][0]["message"]["tool_calls"] == calls
    prose = out["prose"]["response"]["body"]["choices"][0]
    assert "tool_calls" not in prose["message"] and isinstance(prose["message"]["content"], str)
