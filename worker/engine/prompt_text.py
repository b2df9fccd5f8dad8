"""Text in and out of token ids: a prompt (a string, or chat messages through the
checkpoint's chat template) to ids, and generated ids back to the text a row holds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from batchgen.jobs.schema.tools import template_messages


class PromptText:
    """The engine's tokenizer, as the engine and the queue loop use it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(
        self,
        prompt: str | Sequence[dict[str, Any]],
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """A string -> token ids; chat messages -> chat template with the generation prompt,
        ``template_kwargs`` its variables (``enable_thinking``, ...), ``tools`` the
        functions it renders (jobs/schema/tools.py). ValueError for variables or tools given to a
        checkpoint without a chat template."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not getattr(self.tokenizer, "chat_template", None):
            for given, name in ((template_kwargs, "chat_template_kwargs"), (tools, "tools")):
                if given:
                    raise ValueError(f"{name} given, but the model has no chat template")
        ids = self.tokenizer.apply_chat_template(
            template_messages(list(prompt)), tools=tools, add_generation_prompt=True,
            tokenize=True, return_dict=False, **(template_kwargs or {}),
        )  # fmt: skip
        return list(ids)

    def prompt_ids(self, prompt: str | Sequence[dict[str, Any]] | Sequence[int]) -> list[int]:
        """Any prompt the engine takes (a string, chat messages or token ids) -> token ids."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if prompt and isinstance(prompt[0], dict):
            return self.encode(cast(Sequence[dict[str, Any]], prompt))
        return [int(t) for t in cast(Sequence[int], prompt)]

    def decode(self, token_ids: Sequence[int], keep_special: bool = False) -> str:
        """Generated tokens' text as an output's ``text`` holds it (special tokens skipped;
        ``keep_special``: kept, for a tool-call parser whose markers are special tokens)."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=not keep_special))

    def token_text(self, token_id: int) -> str:
        """One token's text alone, as logprobs show it."""
        return str(self.tokenizer.decode([token_id], skip_special_tokens=False))
