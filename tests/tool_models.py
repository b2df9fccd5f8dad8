"""Qwen-shaped toy chat checkpoints for tool calls and reasoning, what the tests ask them
with, and how a test drives them: a line at submit, or a batch through serve.

``write_chat_model`` builds a toy checkpoint whose tokenizer has the given added (not
special) tokens inside the embedding table, as the releases have them, and a chat
template; the test modules build theirs in module-scoped fixtures from it.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.intake.lines import LineError
from batchgen.jobs.schema.sampling import DEFAULTS

# -- the tools a request offers ----------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False,
}  # fmt: skip
TIME_PARAMS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}  # fmt: skip
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
NAMED = {"type": "function", "function": {"name": "get_time"}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]

# -- chat templates as the releases write them -------------------------------------------

# Qwen2.5's chat template (the hermes tool format) as the release writes it.
QWEN_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    '\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
THINK_TOKENS = ["<think>", "</think>"]

# -- the checkpoint ----------------------------------------------------------------------


def write_chat_model(out: Path, arch: str, added: list[str], template: str) -> Path:
    """A toy ``arch`` checkpoint in ``out`` whose tokenizer has ``added`` as added (not
    special) tokens, in that order, inside the embedding table, and ``template`` as its
    chat template."""
    from transformers import AutoTokenizer

    from batchgen.toy import write_toy_checkpoint
    from batchgen.toy.checkpoint import SIZES

    size = replace(SIZES["tiny"], tokenizer_vocab_size=SIZES["tiny"].vocab_size - len(added))
    write_toy_checkpoint(out, arch=arch, size=size)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(added)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
    return out


# -- driving it --------------------------------------------------------------------------


def queue_entry(line: dict, defaults: dict | None = None) -> dict:
    """The queue entry a submitted line becomes (the job's ``defaults`` over DEFAULTS)."""
    out = parse_line(1, json.dumps(line).encode(), {**DEFAULTS, **(defaults or {})})
    assert not isinstance(out, LineError), str(out)
    return json.loads(out)


def refusal(line: dict, defaults: dict | None = None) -> str:
    """The error a submitted line is refused with."""
    out = parse_line(1, json.dumps(line).encode(), {**DEFAULTS, **(defaults or {})})
    assert isinstance(out, LineError), out
    return str(out)


def batch_line(messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    """A line in OpenAI's batch format asking ``messages`` with ``body``."""
    return {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": messages, **body}}  # fmt: skip


def serve_batch(model: Path, folder: Path, messages: list[dict[str, Any]],
                bodies: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """``messages`` asked with each body (by custom_id) as one batch through a real
    ``batchgen serve`` and a CPU worker, read with the official ``openai`` client:
    (the output lines by custom_id, the completed batch as the client reads it)."""
    from openai import OpenAI

    from tests.serve_stack import KEY, private_stack

    requests = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": str(model), "messages": messages, **body}}
                for cid, body in bodies.items()]  # fmt: skip
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    with private_stack(folder / "stack", model) as stack:
        stack.serve("--api-key", KEY)
        stack.worker(model)
        client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
        with (folder / "in.jsonl").open("rb") as f:
            file = client.files.create(file=f, purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        for _ in range(1500):
            batch = client.batches.retrieve(batch.id)
            if batch.status in ("completed", "failed", "cancelled", "expired"):
                break
            time.sleep(0.2)
        assert batch.status == "completed", batch
        assert batch.output_file_id is not None
        text = client.files.content(batch.output_file_id).text
    return {line["custom_id"]: line for line in map(json.loads, text.splitlines())}, batch
