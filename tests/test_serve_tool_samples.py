"""n > 1 with tools and a reasoning parser through a real ``batchgen serve`` and worker,
read with the official ``openai`` client: every sample its own choice, each a valid call
with its reasoning, and usage counting every sample, as OpenAI's Batch API returns it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.cli_session import rows
from tests.tool_models import (
    ASK,
    QWEN_TEMPLATE,
    QWEN_TOOL_TOKENS,
    SCHEMAS,
    THINK_TOKENS,
    TOOLS,
    serve_batch,
    write_chat_model,
)

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
    """A toy qwen3 with Qwen's tool and think tokens and a chat template that renders tools
    and takes ``enable_thinking``."""
    return write_chat_model(tmp_path_factory.mktemp("qwen3-tools"), "qwen3",
                            [*QWEN_TOOL_TOKENS, *THINK_TOKENS], THINKING_TEMPLATE)  # fmt: skip


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
    out, batch = serve_batch(thinking_tools_model, tmp_path, ASK, bodies)
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
