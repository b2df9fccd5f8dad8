"""Reasoning parsers: a generated text in, its reasoning and its answer out.

A job names one (``--reasoning-parser NAME``) or gets the one its checkpoint's chat
template makes unambiguous (``detect``). Parsers are strings in, strings out: the
worker gives the decoded output (and whether the rendered prompt already closed the
reasoning), the parser says where the reasoning ends; the row's ``reasoning`` and
``text`` columns and its ``reasoning_tokens`` follow from that (worker/loop/flight.py).
Output parsers of other kinds (tool calls) live beside this module, one per concept.

Names, as vLLM's ``--reasoning-parser`` spells them:

- ``qwen3``: Qwen3 writes ``<think>\\n...\\n</think>\\n\\nanswer``; a thinking-only
  release (Qwen3-2507) opens ``<think>`` in its template and writes only the end.
- ``deepseek_r1``: DeepSeek-R1's template opens ``<think>``, so the output starts
  inside the reasoning and holds only ``</think>`` (older releases repeat ``<think>``).
- ``think``: the same rule with the default tags; ``think:START,END`` with your own
  (``think:<reasoning>,</reasoning>``).
- ``gpt_oss``: gpt-oss writes OpenAI's harmony channels,
  ``<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>
  answer<|return|>``; the reasoning is the analysis message, the answer the final
  one's (without a final message, all that follows the reasoning, such as a
  ``commentary`` tool call). Its markers are special tokens, so it reads the output
  decoded with special tokens kept (``keeps_special``).

The rule all three follow: a leading start tag is dropped; the reasoning runs to the
first end tag, the answer is everything after it; when the end tag never comes,
everything generated is reasoning. A prompt that ends with the end tag (the template
closed the reasoning, as Qwen3's ``enable_thinking: false`` does) leaves nothing to
parse: all of the output is answer.

A structured output (or a forced tool call) asked together with a parser constrains
the answer alone, as vLLM does: the engine samples freely until the parser's
``answer_marker`` (the end tag; harmony's final-message start) and the grammar starts
at the text after it (worker/engine/constrained.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from batchgen.jobs.schema.errors import ParserError

START, END = "<think>", "</think>"
NAMES = ("qwen3", "deepseek_r1", "think", "gpt_oss")


@dataclass(frozen=True, slots=True)
class Split:
    """Where a generated text's reasoning ends."""

    reasoning: str | None  # None: no reasoning (the prompt closed it)
    text: str  # the answer
    reasoning_chars: int  # characters of the output up to and including the end tag


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """A parser of reasoning between a start and an end tag (either may be absent)."""

    name: str  # as the job names it
    start: str = START
    end: str = END
    keeps_special: ClassVar[bool] = False  # reads the output as the row's text holds it

    @property
    def answer_marker(self) -> str:
        """The text after which the answer begins (where a structured output starts)."""
        return self.end

    def closed_by(self, prompt_tail: str) -> bool:
        """Whether a rendered prompt ending in ``prompt_tail`` already closed the
        reasoning (the model then writes only its answer)."""
        return prompt_tail.rstrip().endswith(self.end)

    def split(self, output: str, closed: bool = False) -> Split:
        """``output`` as reasoning and answer; ``closed``: the prompt closed the reasoning."""
        if closed:
            return Split(None, output, 0)
        skipped = len(self.start) if self.start and output.startswith(self.start) else 0
        end = output.find(self.end, skipped)
        if end < 0:
            return Split(output[skipped:], "", len(output))
        stop = end + len(self.end)
        return Split(output[skipped:end], output[stop:], stop)


@dataclass(frozen=True, slots=True)
class HarmonyChannels:
    """gpt-oss's harmony channels: the analysis message is the reasoning."""

    name: str = "gpt_oss"
    end: str = "<|end|>"  # ends the analysis message
    keeps_special: ClassVar[bool] = True
    ANALYSIS: ClassVar[str] = "<|channel|>analysis<|message|>"
    FINAL: ClassVar[str] = "<|channel|>final<|message|>"
    STOPS: ClassVar[tuple[str, ...]] = ("<|return|>", "<|call|>", "<|end|>")  # end a message

    @property
    def answer_marker(self) -> str:
        """The text after which the answer begins: the final message's start."""
        return self.FINAL

    def closed_by(self, prompt_tail: str) -> bool:
        """Whether the prompt already opened the final message (no reasoning to come)."""
        return prompt_tail.rstrip().endswith(self.FINAL)

    def split(self, output: str, closed: bool = False) -> Split:
        """``output`` (special tokens kept) as the analysis message and the answer."""
        if closed:
            return Split(None, self._message(output), 0)
        if not output.startswith(self.ANALYSIS):  # no analysis channel: all answer
            return Split(None, self._answer(output), 0)
        end = output.find(self.end, len(self.ANALYSIS))
        if end < 0:
            return Split(output[len(self.ANALYSIS) :], "", len(output))
        stop = end + len(self.end)
        return Split(output[len(self.ANALYSIS) : end], self._answer(output[stop:]), stop)

    def _answer(self, rest: str) -> str:
        """The final message's text; without one, what follows the reasoning as written."""
        at = rest.find(self.FINAL)
        if at < 0:
            return rest
        return self._message(rest[at + len(self.FINAL) :])

    def _message(self, text: str) -> str:
        """A message's text, up to the token that ends it."""
        ends = [i for i in (text.find(stop) for stop in self.STOPS) if i >= 0]
        return text[: min(ends)] if ends else text


ReasoningParser = ThinkTags | HarmonyChannels


def parser(spec: str) -> ReasoningParser:
    """The parser a job's ``--reasoning-parser`` names; ParserError when none is."""
    if spec == "gpt_oss":
        return HarmonyChannels()
    if spec in NAMES:
        return ThinkTags(spec)
    name, colon, tags = spec.partition(":")
    if name == "think" and colon:
        start, comma, end = tags.partition(",")
        if comma and start and end and "," not in end:
            return ThinkTags(spec, start, end)
        raise ParserError(f"--reasoning-parser {spec}: write think:START,END (two non-empty "
                          "tags, e.g. think:<reasoning>,</reasoning>)")  # fmt: skip
    raise ParserError(f"unknown reasoning parser {spec!r}: one of {', '.join(NAMES)} or "
                      "think:START,END")  # fmt: skip


def detect(chat_template: str | None) -> str:
    """The parser a chat template makes unambiguous: ``gpt_oss`` for one that writes
    harmony's analysis channel, ``qwen3`` for a template that
    writes ``<think>`` and ``</think>`` and takes ``enable_thinking`` (Qwen3's switch),
    ``deepseek_r1`` for one that opens ``<think>`` in its generation prompt without that
    switch, ``think`` for any other template that writes both tags; "" when it
    mentions no think tags (no parser: the output is all answer)."""
    if chat_template and "<|channel|>" in chat_template and "analysis" in chat_template:
        return "gpt_oss"
    if not chat_template or START not in chat_template or END not in chat_template:
        return ""
    if "enable_thinking" in chat_template:
        return "qwen3"
    if "<｜Assistant｜>" in chat_template:  # DeepSeek's turn marker (fullwidth bars)
        return "deepseek_r1"
    return "think"
