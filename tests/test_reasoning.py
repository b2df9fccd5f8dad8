"""Reasoning: parsers on the real releases' output shapes, chat_template_kwargs rendered
as transformers renders them, and the reasoning column through the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchgen.jobs.schema.errors import ParserError
from batchgen.jobs.schema.reasoning import Split, ThinkTags, detect, parser
from tests.cli_session import Shell, rows, write_jsonl
from tests.tool_models import (
    THINK_TOKENS,
    batch_line,
    queue_entry,
    refusal,
    serve_batch,
    write_chat_model,
)

QWEN3 = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
R1 = "The user greets me; answer briefly.\n</think>\n\nHello!"  # the template opened <think>


def test_qwen3_output_splits_at_the_end_tag_and_drops_the_leading_start_tag():
    split = parser("qwen3").split(QWEN3)
    assert split == Split("\nThe user greets me.\n", "\n\nHello! How can I help?",
                          QWEN3.index("</think>") + len("</think>"))  # fmt: skip


def test_deepseek_r1_output_starts_inside_the_reasoning():
    split = parser("deepseek_r1").split(R1)
    assert split == Split("The user greets me; answer briefly.\n", "\n\nHello!", R1.index("\n\nH"))
    # an older release repeats the opening tag: dropped the same way
    assert parser("deepseek_r1").split("<think>" + R1) == Split(
        "The user greets me; answer briefly.\n", "\n\nHello!", len("<think>") + R1.index("\n\nH")
    )


def test_a_missing_end_tag_makes_everything_reasoning():
    cut = "<think>\nLet me count: 1, 2, 3"
    assert parser("qwen3").split(cut) == Split("\nLet me count: 1, 2, 3", "", len(cut))
    assert parser("deepseek_r1").split("no tags at all") == Split("no tags at all", "", 14)
    assert parser("qwen3").split("") == Split("", "", 0)


def test_only_the_first_end_tag_ends_the_reasoning():
    out = "a</think>b</think>c"
    assert parser("think").split(out) == Split("a", "b</think>c", 9)


def test_a_prompt_that_closed_the_reasoning_leaves_all_of_the_output_answer():
    qwen3 = parser("qwen3")
    # Qwen3's template with enable_thinking false ends the prompt so
    assert qwen3.closed_by("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.closed_by("<|im_start|>assistant\n")
    assert not qwen3.closed_by("<｜Assistant｜><think>\n")
    assert qwen3.split("Hello!", closed=True) == Split(None, "Hello!", 0)


def test_a_generic_parser_takes_its_own_tags():
    tags = parser("think:<reasoning>,</reasoning>")
    assert tags == ThinkTags("think:<reasoning>,</reasoning>", "<reasoning>", "</reasoning>")
    assert tags.split("<reasoning>hm</reasoning>yes") == Split("hm", "yes", 25)
    assert tags.split("<think>hm</think>yes") == Split("<think>hm</think>yes", "", 20)


# gpt-oss's harmony output as the release writes it (after the prompt's <|start|>assistant)
HARMONY = ("<|channel|>analysis<|message|>User greets. Reply briefly.<|end|><|start|>assistant"
           "<|channel|>final<|message|>Hello! How can I help?<|return|>")  # fmt: skip


def test_gpt_oss_reads_the_analysis_and_final_channels():
    gpt_oss = parser("gpt_oss")
    assert gpt_oss.keeps_special and not parser("qwen3").keeps_special
    end = HARMONY.index("<|end|>") + len("<|end|>")
    assert gpt_oss.split(HARMONY) == Split("User greets. Reply briefly.", "Hello! How can I help?",
                                           end)  # fmt: skip
    # cut while it reasoned: everything is reasoning
    cut = "<|channel|>analysis<|message|>User greets. Re"
    assert gpt_oss.split(cut) == Split("User greets. Re", "", len(cut))
    # a tool call instead of a final message: what follows the reasoning stays as written
    call = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
            "commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city":"Paris"}<|call|>')  # fmt: skip
    split = gpt_oss.split(call)
    assert split.reasoning == "Need weather." and split.text == call[call.index("<|start|>") :]
    # no analysis channel, or a prompt that opened the final message: all answer
    assert gpt_oss.split("<|channel|>final<|message|>Hi<|return|>") == Split(None, "Hi", 0)
    assert gpt_oss.closed_by("<|start|>assistant<|channel|>final<|message|>")
    assert gpt_oss.split("Hi<|return|>", closed=True) == Split(None, "Hi", 0)
    assert detect("{{ '<|channel|>analysis<|message|>' }}") == "gpt_oss"


def test_gpt_oss_reasoning_tokens_count_through_its_end_marker():
    from batchgen.worker.loop.flight import reasoning_tokens

    pieces = ["<|channel|>", "analysis", "<|message|>", "Hm", ".", "<|end|>", "<|start|>",
              "assistant", "<|channel|>", "final", "<|message|>", "Hi", "<|return|>"]  # fmt: skip
    ids = list(range(len(pieces)))
    output = "".join(pieces)
    split = parser("gpt_oss").split(output)
    count = reasoning_tokens(ids, output, split, "<|end|>",
                             lambda part: "".join(pieces[i] for i in part))  # fmt: skip
    assert (split.reasoning, split.text, count) == ("Hm.", "Hi", 6)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("qwen", "unknown reasoning parser 'qwen': one of qwen3, deepseek_r1, think, gpt_oss "
                 "or think:START,END"),
        ("think:<r>", "--reasoning-parser think:<r>: write think:START,END (two non-empty "
                      "tags, e.g. think:<reasoning>,</reasoning>)"),
        ("think:,</r>", "--reasoning-parser think:,</r>: write think:START,END (two non-empty "
                        "tags, e.g. think:<reasoning>,</reasoning>)"),
    ],
)  # fmt: skip
def test_a_wrong_name_says_which_exist(spec, message):
    with pytest.raises(ParserError) as caught:
        parser(spec)
    assert str(caught.value) == message


def test_detect_reads_the_chat_template():
    assert detect(None) == ""
    assert detect("{{ messages }}") == ""
    assert detect(QWEN3_TEMPLATE) == "qwen3"
    assert detect("<｜Assistant｜>{% if add_generation_prompt %}<think>\n{% endif %}</think>") == (
        "deepseek_r1"
    )
    assert detect("<think>{{ x }}</think>") == "think"


# Qwen3's chat template, its thinking switch and message rendering as the release writes
# them (tools left out: batchgen renders no tools yet).
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


# -- chat_template_kwargs at submit ------------------------------------------------------


MESSAGES = [{"role": "user", "content": "hi"}]
JOB = {"chat_template_kwargs": {"enable_thinking": False, "x": 1}}


def test_template_variables_reach_the_entry_the_lines_over_the_jobs():
    native = {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": True}}
    assert queue_entry(native)["ct"] == {"enable_thinking": True}
    assert queue_entry(native, JOB)["ct"] == {"enable_thinking": True, "x": 1}
    assert queue_entry({"messages": MESSAGES}, JOB)["ct"] == {"enable_thinking": False, "x": 1}
    # the job's variables are not sampling parameters, and a prompt line has none
    assert "chat_template_kwargs" not in queue_entry({"messages": MESSAGES}, JOB)["s"]
    assert "ct" not in queue_entry({"prompt": "hi"}, JOB)
    assert "ct" not in queue_entry({"messages": MESSAGES})
    assert queue_entry(batch_line(MESSAGES, chat_template_kwargs={"thinking": True}), JOB)["ct"] == {
        "enable_thinking": False, "x": 1, "thinking": True}  # fmt: skip
    # OpenAI's reasoning_effort is gpt-oss's template variable
    assert queue_entry(batch_line(MESSAGES, reasoning_effort="high"))["ct"] == {
        "reasoning_effort": "high"
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}},
         "line 1, column 42: chat_template_kwargs needs messages: a prompt is not rendered by "
         "the chat template"),
        ({"messages": MESSAGES, "chat_template_kwargs": True},
         "chat_template_kwargs must be an object of chat template variables, got true"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}},
         "chat_template_kwargs.tokenize is apply_chat_template's own argument, not a template "
         "variable"),
        ({"messages": MESSAGES, "chat_template_kwargs": {"a b": 1}},
         'chat_template_kwargs keys must be template variable names, got "a b"'),
        (batch_line(MESSAGES, reasoning_effort="max"),
         'reasoning_effort must be one of minimal, low, medium, high, got "max"'),
        ({"custom_id": "c", "method": "POST", "url": "/v1/completions",
          "body": {"prompt": "hi", "reasoning_effort": "low"}},
         "/v1/completions has no chat template for reasoning_effort"),
    ],
)  # fmt: skip
def test_wrong_template_variables_are_refused_by_name(line, message):
    assert message in refusal(line)


# -- a Qwen3-shaped toy checkpoint, through the engine and the CLI -----------------------


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """A toy qwen3 with Qwen3's think tags and its chat template."""
    return write_chat_model(tmp_path_factory.mktemp("qwen3-think"), "qwen3", THINK_TOKENS,
                            QWEN3_TEMPLATE)  # fmt: skip


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]


def test_enable_thinking_renders_the_prompt_as_transformers_does(qwen3_model):
    from transformers import AutoTokenizer

    from batchgen import Engine

    hf = AutoTokenizer.from_pretrained(str(qwen3_model))
    engine = Engine.from_pretrained(qwen3_model, num_kv_blocks=64, device="cpu")
    off = engine.encode(CHAT, {"enable_thinking": False})
    assert off == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, enable_thinking=False)  # fmt: skip
    on = engine.encode(CHAT)
    assert on == hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)  # fmt: skip
    assert engine.encode(CHAT, {"enable_thinking": True}) == on
    # the switch adds Qwen3's empty reasoning to the prompt, nothing else
    assert off[: len(on)] == on
    assert hf.decode(off[len(on) :]) == "<think>\n\n</think>\n\n"
    assert detect(hf.chat_template) == "qwen3"


def test_variables_for_a_model_without_a_chat_template_are_refused_by_name(toy_model, tmp_path):
    import shutil

    from batchgen import Engine

    plain = Path(shutil.copytree(toy_model("llama"), tmp_path / "plain"))
    config = plain / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    settings.pop("chat_template", None)
    config.write_text(json.dumps(settings))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    engine = Engine.from_pretrained(plain, num_kv_blocks=64, device="cpu")
    with pytest.raises(ValueError) as caught:
        engine.encode(CHAT, {"enable_thinking": False})
    assert str(caught.value) == "chat_template_kwargs given, but the model has no chat template"


def test_the_reasoning_column_through_the_cli(qwen3_model, tmp_path, private_redis):
    from transformers import AutoTokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(qwen3_model))
    end_id = hf.convert_tokens_to_ids("</think>")
    (tmp_path / "qwen3").symlink_to(qwen3_model)
    lines = [{"id": f"b{bias}", "messages": CHAT, "max_tokens": 24, "ignore_eos": True,
              "logit_bias": {str(end_id): bias}} for bias in (0, 4, 6, 8, 10, 100)]  # fmt: skip
    lines.append({"id": "off", "messages": CHAT, "max_tokens": 8, "ignore_eos": True,
                  "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    write_jsonl(tmp_path / "p.jsonl", lines)
    shell = Shell(tmp_path, tmp_path / "home", private_redis.url)
    # no --reasoning-parser: the template's think tags and enable_thinking choose qwen3
    out = shell.run("run", "p.jsonl", "--model", "qwen3", "-o", "out.parquet", "--job-id",
                    "think", "--device", "cpu", "--job-output", str(tmp_path / "job"))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    status = shell.status("think")
    got = rows(tmp_path / "out.parquet")
    assert status["reasoning_parser"] == "qwen3"
    assert status["reasoning_tokens"] == sum(got["reasoning_tokens"]) > 0
    split_inside = 0
    for i, row_id in enumerate(got["id"]):
        ids, text, reasoning = got["token_ids"][i], got["text"][i], got["reasoning"][i]
        decoded = hf.decode(ids, skip_special_tokens=True)
        if row_id == "off":  # the prompt closed the reasoning: all answer
            assert (reasoning, text, got["reasoning_tokens"][i]) == (None, decoded, 0)
            assert got["prompt_tokens"][i] == len(hf.apply_chat_template(
                CHAT, add_generation_prompt=True, tokenize=True, return_dict=False,
                enable_thinking=False))  # fmt: skip
            continue
        opened = "<think>" if decoded.startswith("<think>") else ""
        if end_id in ids:
            assert opened + reasoning + "</think>" + text == decoded
            assert got["reasoning_tokens"][i] == ids.index(end_id) + 1
            split_inside += 0 < ids.index(end_id) < len(ids) - 1
        else:  # the end tag never came: everything generated is reasoning
            assert (opened + reasoning, text) == (decoded, "")
            assert got["reasoning_tokens"][i] == len(ids)
    assert got["text"][got["id"].index("b100")] == "</think>" * 23  # all end tags: answer
    assert split_inside, got["token_ids"]  # a row whose reasoning and answer both hold tokens


def test_serve_returns_reasoning_content_and_reasoning_tokens(qwen3_model, tmp_path):
    from transformers import AutoTokenizer

    hf: Any = AutoTokenizer.from_pretrained(str(qwen3_model))
    end_id = hf.convert_tokens_to_ids("</think>")
    bodies = {f"b{bias}": {"max_tokens": 16, "logit_bias": {str(end_id): bias}}
              for bias in (0, 6, 8, 100)}  # fmt: skip
    out, batch = serve_batch(qwen3_model, tmp_path, CHAT, bodies)
    assert batch.usage is not None
    reasoned = batch.usage.output_tokens_details.reasoning_tokens
    assert batch.metadata is not None
    table = rows(Path(batch.metadata["batchgen_result"]))
    token_ids = dict(zip(table["id"], table["token_ids"]))
    assert sorted(out) == ["b0", "b100", "b6", "b8"]
    for line in out.values():
        body = line["response"]["body"]
        ids = token_ids[line["custom_id"]]
        message = body["choices"][0]["message"]
        count = ids.index(end_id) + 1 if end_id in ids else len(ids)
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": count}
        decoded = hf.decode(ids, skip_special_tokens=True).removeprefix("<think>")
        if end_id in ids:
            assert message["reasoning_content"] + "</think>" + message["content"] == decoded
        else:
            assert (message["reasoning_content"], message["content"]) == (decoded, "")
    # all end tags: no reasoning, one token of it (its end tag)
    assert token_ids["b100"] == [end_id] * 16
    assert (
        reasoned
        == sum(table["reasoning_tokens"])
        == sum(
            line["response"]["body"]["usage"]["completion_tokens_details"]["reasoning_tokens"]
            for line in out.values()
        )
    )
