"""Reasoning: parsers on the real releases' output shapes, chat_template_kwargs rendered
as transformers renders them, and the reasoning column through the CLI."""

from __future__ import annotations

import pytest

from batchgen.jobs.schema.reasoning import ParserError, Split, ThinkTags, detect, parser

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


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("qwen", "unknown reasoning parser 'qwen': one of qwen3, deepseek_r1, think or "
                 "think:START,END"),
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
