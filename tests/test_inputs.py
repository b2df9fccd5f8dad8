"""Input validation: hostile lines are rejected with their line, column and reason."""

from __future__ import annotations

import json

import pytest

from batchgen.jobs.intake.inputs import LineError, parse_line
from batchgen.jobs.intake.strictjson import MAX_VALUES
from batchgen.jobs.schema.errors import ParamError
from batchgen.jobs.schema.sampling import DEFAULTS, job_defaults

DEEP = "[" * 10_000 + "]" * 10_000
HOSTILE = [
    ('{"prompt": "hi"', 16, "malformed JSON: Expecting ',' delimiter"),
    ('{"prompt": "hi", "temperature": NaN}', 33, "NaN is not a valid JSON number"),
    ('{"prompt": "hi", "temperature": -Infinity}', 33, "-Infinity is not a valid JSON number"),
    ('{"prompt": "a", "prompt": "b"}', 17, "duplicate key 'prompt'"),
    ('{"prompt": "hi", "max_tokens": ' + "1" * 10_000 + "}", 32,
     "integer with 10000 digits (at most 20 allowed)"),
    ('{"prompt": "hi", "metadata": ' + DEEP + "}", 61, "nested deeper than 32 levels"),
    ('{"prompt": "hi", "max_tokens": 0}', 32,
     "max_tokens must be an integer from 1 to 1048576, got 0"),
    ('{"prompt": "hi", "max_tokens": -1}', 32,
     "max_tokens must be an integer from 1 to 1048576, got -1"),
    ('{"prompt": "hi", "max_tokens": 1000000000}', 32,
     "max_tokens must be an integer from 1 to 1048576, got 1000000000"),
    ('{"prompt": "hi", "max_tokens": 1e9}', 32,
     "max_tokens must be an integer from 1 to 1048576, got 1000000000.0"),
    ('{"prompt": "hi", "temperature": 1e400}', 33, "number 1e400 is out of range"),
    ('{"prompt": "hi", "max_tokens": "x"}', 32,
     'max_tokens must be an integer from 1 to 1048576, got "x"'),
    ('{"prompt": "hi", "max_tokens": true}', 32,
     "max_tokens must be an integer from 1 to 1048576, got true"),
    ('{"prompt": "hi", "temperature": -0.5}', 33,
     "temperature must be a number >= 0 and <= 100, got -0.5"),
    ('{"prompt": "hi", "top_p": 0}', 27, "top_p must be a number in (0, 1], got 0"),
    ('{"prompt": "hi", "top_p": 1.5}', 27, "top_p must be a number in (0, 1], got 1.5"),
    ('{"prompt": "hi", "top_k": -1}', 27,
     "top_k must be an integer from 0 to 1048576 (0 turns it off), got -1"),
    ('{"prompt": ""}', 12, "prompt is empty"),
    ('{"prompt": "hi", "max_token": 5}', 18, "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ('{"prompt": "hi", "messages": [{"role": "user", "content": "x"}]}', 1,
     'give exactly one of "prompt" or "messages"'),
    ("[1, 2]", 1, "a line must be a JSON object"),
    ('{"messages": []}', 14, "messages must be a non-empty list of {role, content} objects"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', 24,
     "role must be one of system, developer, user, assistant, tool"),
    ('{"prompt": "a\\ud800b"}', 14, "unpaired surrogate escape (not valid Unicode)"),
    ('{"prompt": "hi", "stop": [""]}', 26, "each stop string must have 1 to 1000 characters"),
    ('{"prompt": "hi", "metadata": [1]}', 30, "metadata must be an object"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {"input": "x"}}', 45,
     "url must be one of /v1/chat/completions, /v1/completions, /v1/embeddings"),
    ('{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}', 1,
     'OpenAI batch line without "custom_id"'),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "frobnicate": 2}}',
     88, "unknown field 'body.frobnicate'"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["x", "y"]}}',
     83, "prompt must be one string (one prompt per line)"),
    # one level past the limit (the limit itself: NESTED_32 below)
    ('{"prompt": "x", "metadata": {"a": ' + "[" * 31 + "]" * 31 + "}}", 65,
     "nested deeper than 32 levels"),
    # an escaped backslash, then text: the lone surrogate is the second one
    ('{"prompt": "\\\\ud800 \\ud800"}', 21, "unpaired surrogate escape (not valid Unicode)"),
    ('{"prompt": "x", "\\u0070rompt": "y"}', 17, "duplicate key 'prompt'"),
    # siblings before the field hold brackets, quotes and backslashes in strings
    ('{"prompt": "x", "metadata": {"a": "]}\\"{", "b": [{"c": "\\\\"}]}, "extra": 1}', 65,
     "unknown field 'extra'"),
    # user text in a message is cut (a key can be megabytes long)
    ('{"prompt": "x", "' + "k" * 100 + '": 1}', 17, f"unknown field '{'k' * 60}'..."),
    ('{"prompt": "x", "metadata": {"' + "k" * 100 + '": 1, "' + "k" * 100 + '": 2}}', 137,
     f"duplicate key '{'k' * 60}'..."),
    ('{"custom_id": "a", "method": "' + "P" * 100 + '", "url": "/v1/completions", "body": {}}', 30,
     f'method must be "POST", got "{"P" * 59}'),
    ('{"messages": [{"role": "user", "content": "x", "' + "n" * 100 + '": 1}]}', 48,
     f"unknown message field '{'n' * 60}'..."),
]  # fmt: skip
NESTED_32 = '{"prompt": "x", "metadata": {"a": ' + "[" * 30 + "]" * 30 + "}}"
BRACKETS_IN_STRING = '{"prompt": "' + "[{" * 100 + '"}'


@pytest.mark.parametrize(("line", "column", "message"), HOSTILE)
def test_hostile_line_names_line_column_and_reason(line: str, column: int, message: str):
    error = parse_line(7, line.encode(), DEFAULTS)
    assert isinstance(error, LineError)
    assert (error.line, error.column, error.message) == (7, column, message)
    assert str(error) == f"line 7, column {column}: {message}"


@pytest.mark.parametrize("line", [NESTED_32, BRACKETS_IN_STRING])
def test_nesting_at_the_limit_and_brackets_in_strings_are_accepted(line: str):
    entry = parse_line(1, line.encode(), DEFAULTS)
    assert isinstance(entry, bytes)
    assert json.loads(entry)["p"] == json.loads(line)["prompt"]


def test_values_and_keys_in_a_line_are_capped():
    # 10 values and keys around the parts, 5 per part: exactly MAX_VALUES
    parts = [{"type": "text", "text": "a"}] * ((MAX_VALUES - 10) // 5)
    message = {"role": "user", "name": "n", "content": parts}
    at_cap = json.dumps({"messages": [message]})
    entry = parse_line(1, at_cap.encode(), DEFAULTS)
    assert isinstance(entry, bytes)
    assert json.loads(entry)["m"] == [{"role": "user", "content": "a" * len(parts), "name": "n"}]
    over = json.dumps({"messages": [message], "stop": "x"})  # a key and a value more
    error = parse_line(1, over.encode(), DEFAULTS)
    assert str(error) == "line 1, column 1: more than 200,000 JSON values and keys in one line"


def test_native_line_becomes_a_self_contained_entry():
    defaults = job_defaults({"max_tokens": 32, "temperature": 0.7, "stop": ("END",)})
    line = '{"id": 5, "prompt": "hi", "temperature": 0, "seed": 3, "metadata": {"k": [1]}}'
    raw = parse_line(1, line.encode(), defaults)
    # the exact bytes: a job's fingerprint is their sha256, so they must never change
    assert raw == (
        b'{"id":"5","p":"hi","s":{"max_tokens":32,"temperature":0.0,"top_p":1.0,"top_k":0,'
        b'"stop":["END"],"seed":3},"md":{"k":[1]}}'
    )
    entry = json.loads(raw)
    assert entry == {
        "id": "5",
        "p": "hi",
        "s": {"max_tokens": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stop": ["END"],
              "seed": 3},
        "md": {"k": [1]},
    }  # fmt: skip


def test_openai_chat_line_maps_to_messages_and_custom_id():
    line = json.dumps({
        "custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "ignored", "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
        ], "max_completion_tokens": 9, "top_p": 0.5, "stop": "\n", "user": "u1"},
    })  # fmt: skip
    entry = json.loads(parse_line(1, line.encode(), DEFAULTS))  # type: ignore[arg-type]
    assert entry == {
        "id": "req-1",
        "m": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
        "s": {"max_tokens": 9, "temperature": 0.0, "top_p": 0.5, "top_k": 0, "stop": ["\n"]},
    }


def test_openai_completions_line_maps_to_prompt():
    line = '{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 4}}'
    entry = json.loads(parse_line(1, line.encode(), DEFAULTS))  # type: ignore[arg-type]
    assert entry == {"id": "c", "p": "x", "s": {**DEFAULTS, "max_tokens": 4}}


def test_invalid_utf8_names_its_column():
    error = parse_line(2, b'{"prompt": "\xc3\xa9\xff"}', DEFAULTS)
    assert isinstance(error, LineError)
    assert (error.line, error.column, error.message) == (2, 14, "invalid UTF-8 (byte 0xff)")


def test_job_defaults_from_flags_are_checked_with_the_flag_name():
    assert job_defaults({"max_tokens": None, "stop": ()}) == DEFAULTS
    with pytest.raises(ParamError, match=r"^--temperature: temperature must be a number >= 0"):
        job_defaults({"temperature": -1.0})
    with pytest.raises(ParamError, match=r"^--top-p: top_p must be a number in \(0, 1\], got 2"):
        job_defaults({"top_p": 2.0})
    # flags are parsed by click as floats: nan and inf get through the parser
    with pytest.raises(ParamError, match=r"^--temperature: .* got NaN$"):
        job_defaults({"temperature": float("nan")})
    with pytest.raises(ParamError, match=r"^--temperature: .* got Infinity$"):
        job_defaults({"temperature": float("inf")})
    with pytest.raises(ParamError, match=r"^--top-p: .* got NaN$"):
        job_defaults({"top_p": float("nan")})
