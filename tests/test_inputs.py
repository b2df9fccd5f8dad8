"""Input validation: hostile lines are rejected with their line, column and reason."""

from __future__ import annotations

import io
import json
import tracemalloc

import pytest

from batchgen.jobs.inputs import LineError, parse_line, read_lines
from batchgen.jobs.params import DEFAULTS, ParamError, job_defaults

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
    ('{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}', 45,
     "url must be one of /v1/chat/completions, /v1/completions"),
    ('{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}', 1,
     'OpenAI batch line without "custom_id"'),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 2}}',
     88, "unknown field 'body.logprobs'"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": ["x", "y"]}}',
     83, "prompt must be one string (one prompt per line)"),
]  # fmt: skip


@pytest.mark.parametrize(("line", "column", "message"), HOSTILE)
def test_hostile_line_names_line_column_and_reason(line: str, column: int, message: str):
    error = parse_line(7, line, DEFAULTS)
    assert isinstance(error, LineError)
    assert (error.line, error.column, error.message) == (7, column, message)
    assert str(error) == f"line 7, column {column}: {message}"


def test_native_line_becomes_a_self_contained_entry():
    defaults = job_defaults({"max_tokens": 32, "temperature": 0.7, "stop": ("END",)})
    line = '{"id": 5, "prompt": "hi", "temperature": 0, "seed": 3, "metadata": {"k": [1]}}'
    entry = json.loads(parse_line(1, line, defaults))  # type: ignore[arg-type]
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
    entry = json.loads(parse_line(1, line, DEFAULTS))  # type: ignore[arg-type]
    assert entry == {
        "id": "req-1",
        "m": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
        "s": {"max_tokens": 9, "temperature": 0.0, "top_p": 0.5, "top_k": 0, "stop": ["\n"]},
    }


def test_openai_completions_line_maps_to_prompt():
    line = '{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 4}}'
    entry = json.loads(parse_line(1, line, DEFAULTS))  # type: ignore[arg-type]
    assert entry == {"id": "c", "p": "x", "s": {**DEFAULTS, "max_tokens": 4}}


def test_bom_crlf_and_blank_lines_are_accepted_and_counted():
    data = b'\xef\xbb\xbf{"prompt": "a"}\r\n\r\n   \n{"prompt": "b"}\r\n{"prompt": "c"}'
    lines = list(read_lines(io.BytesIO(data)))
    assert lines == [(1, '{"prompt": "a"}'), (4, '{"prompt": "b"}'), (5, '{"prompt": "c"}')]


def test_invalid_utf8_names_its_column():
    lines = list(read_lines(io.BytesIO(b'{"prompt": "ok"}\n{"prompt": "\xc3\xa9\xff"}\n')))
    assert lines[0] == (1, '{"prompt": "ok"}')
    number, error = lines[1]
    assert isinstance(error, LineError)
    assert (number, error.column, error.message) == (2, 14, "invalid UTF-8 (byte 0xff)")


def test_a_50_mb_line_is_rejected_with_memory_bounded(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"prompt": "first"}\n{"prompt": "')
        for _ in range(50):
            f.write(b"x" * (1 << 20))
        f.write(b'"}\n{"prompt": "last"}\n')
    tracemalloc.start()
    with open(path, "rb") as f:
        lines = list(read_lines(f, max_line_bytes=1 << 20))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 8 << 20, peak  # never the whole 50 MB line
    assert lines[0] == (1, '{"prompt": "first"}')
    assert lines[2] == (3, '{"prompt": "last"}')
    error = lines[1][1]
    assert isinstance(error, LineError)
    assert (
        str(error)
        == "line 2, column 1: line is 52,428,814 bytes, over the limit of 1,048,576 bytes"
    )


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
