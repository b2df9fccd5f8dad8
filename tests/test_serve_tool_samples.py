"""n > 1 with tools and a reasoning parser through a real ``batchgen serve`` and worker,
read with the official ``openai`` client: every sample its own choice, each a valid call
with its reasoning, and usage counting every sample, as OpenAI's Batch API returns it."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.cli_session import rows
from tests.test_tools import ASK, QWEN_TEMPLATE, QWEN_TOOL_TOKENS, SCHEMAS, TOOLS

# Qwen2.5's tool template with Qwen3's thinking switch: hermes calls and qwen3 reasoning,
# both chosen from the template (as Qwen3's own template writes both)
GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
THINKING_TEMPLATE = QWEN_TEMPLATE.replace(GENERATION_PROMPT, (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"))  # fmt: skip
assert THINKING_TEMPLATE != QWEN_TEMPLATE


@pytest.fixture(scope="module")
def thinking_tools_model(tmp_path_factory) -> Path:
    """A toy qwen3 with Qwen's tool and think tokens as added tokens inside the embedding
    table, and a chat template that renders tools and takes ``enable_thinking``."""
    from transformers import AutoTokenizer

    from batchgen.toy import write_toy_checkpoint
    from batchgen.toy.checkpoint import SIZES

    out = tmp_path_factory.mktemp("qwen3-tools")
    added = [*QWEN_TOOL_TOKENS, "<think>", "</think>"]
    size = replace(SIZES["tiny"], tokenizer_vocab_size=SIZES["tiny"].vocab_size - len(added))
    write_toy_checkpoint(out, arch="qwen3", size=size)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(added)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(str(out))
    return out


def _run_batch(model: Path, tmp_path: Path, bodies: dict[str, dict[str, Any]]) -> tuple:
    """The bodies as one batch through serve and a CPU worker: (output lines by custom_id,
    the batch as the client reads it)."""
    from openai import OpenAI

    from tests.serve_stack import KEY, private_stack

    requests = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": str(model), "messages": ASK, **body}}
                for cid, body in bodies.items()]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    with private_stack(tmp_path / "stack", model) as stack:
        stack.serve("--api-key", KEY)
        stack.worker(model)
        client = OpenAI(base_url=stack.base + "/v1", api_key=KEY, max_retries=0)
        with (tmp_path / "in.jsonl").open("rb") as f:
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


def test_serve_returns_every_sample_as_a_call_with_its_reasoning(thinking_tools_model, tmp_path):
    from openai.types.chat import ChatCompletion
    from transformers import AutoTokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(thinking_tools_model))
    end_id = hf.convert_tokens_to_ids("</think>")
    forced = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "max_tokens": 400}
    bodies = {  # a bias on </think> ends the (free) reasoning; the call after it is forced
        "think": {**forced, "n": 2, "seed": 5, "logit_bias": {str(end_id): 9}},
        "plain": {**forced, "n": 3, "seed": 2,
                  "chat_template_kwargs": {"enable_thinking": False}},
    }  # fmt: skip
    out, batch = _run_batch(thinking_tools_model, tmp_path, bodies)
    assert sorted(out) == ["plain", "think"]
    assert batch.metadata is not None
    table = rows(Path(batch.metadata["batchgen_result"]))
    samples = {cid: [c["token_ids"] for c in table["choices"][i]]
               for i, cid in enumerate(table["id"])}  # fmt: skip
    call_ids: list[str] = []
    reasoned_in_all = 0
    for cid, n in (("think", 2), ("plain", 3)):
        body = out[cid]["response"]["body"]
        completion = ChatCompletion.model_validate(body)  # OpenAI's own types
        assert [c.index for c in completion.choices] == list(range(n))
        reasoned = 0
        for choice, ids in zip(completion.choices, samples[cid], strict=True):
            assert choice.finish_reason == "tool_calls"
            message = choice.message
            assert message.content is None and message.tool_calls, body
            for call in message.tool_calls:
                assert call.type == "function" and call.id.startswith("call_")
                name, arguments = call.function.name, call.function.arguments
                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
                call_ids.append(call.id)
            raw = body["choices"][choice.index]["message"]
            if cid == "plain":  # the prompt closed the reasoning: none, and no key for it
                assert "reasoning_content" not in raw
                continue
            # the sample's reasoning: what it wrote before </think>, counted with the tag
            assert end_id in ids
            count = ids.index(end_id) + 1
            decoded = hf.decode(ids[: count - 1], skip_special_tokens=True)
            assert raw["reasoning_content"] == decoded.removeprefix("<think>")
            reasoned += count
        usage = completion.usage
        assert usage is not None and usage.completion_tokens_details is not None
        assert usage.completion_tokens == sum(len(ids) for ids in samples[cid])
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        assert usage.completion_tokens_details.reasoning_tokens == reasoned
        reasoned_in_all += reasoned
    assert len(set(call_ids)) == len(call_ids)  # ids distinct across choices and requests
    # both samples reasoned (a word or more before the tag), and the batch counts them all
    assert all(ids.index(end_id) > 0 for ids in samples["think"]), samples["think"]
    assert batch.usage is not None
    assert batch.usage.output_tokens_details.reasoning_tokens == reasoned_in_all
    assert batch.usage.output_tokens == sum(map(len, samples["think"] + samples["plain"]))
