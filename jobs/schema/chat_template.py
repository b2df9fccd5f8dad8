"""Chat template variables: ``chat_template_kwargs`` of a line, a body or a job.

They reach the checkpoint's chat template as variables when the worker renders a chat
line's messages (``enable_thinking`` for Qwen3, ``thinking`` for others,
``reasoning_effort`` for gpt-oss, which OpenAI bodies set as ``body.reasoning_effort``).
A job's (``submit --chat-template-kwargs``) are merged under each chat line's own. They
are not sampling parameters: a request carries them beside its sampling (entry.py).
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.schema.errors import ParamError
from batchgen.jobs.schema.sampling import show

NAME = "chat_template_kwargs"  # the field's name in lines, bodies and job defaults
# apply_chat_template's own arguments: a template variable of the same name cannot pass
RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})  # fmt: skip
REASONING_EFFORTS = ("minimal", "low", "medium", "high")  # OpenAI's, as gpt-oss's template


def check(value: Any, name: str = NAME) -> dict[str, Any]:
    """The variables as given; ParamError when ``value`` is not an object of names."""
    if not isinstance(value, dict):
        raise ParamError(f"{name} must be an object of chat template variables, got {show(value)}")
    for key in value:
        if not key.isidentifier():
            raise ParamError(f"{name} keys must be template variable names, got {show(key)}")
        if key in RESERVED:
            raise ParamError(f"{name}.{key} is apply_chat_template's own argument, not a "
                             "template variable")  # fmt: skip
    return value


def reasoning_effort(value: Any) -> str:
    """OpenAI's ``reasoning_effort``; ParamError for another value."""
    if value not in REASONING_EFFORTS:
        raise ParamError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, "
                         f"got {show(value)}")  # fmt: skip
    return str(value)


def merged(job: dict[str, Any] | None, line: dict[str, Any] | None) -> dict[str, Any] | None:
    """The variables a chat line renders with: the job's, the line's own over them."""
    if not job:
        return line or None
    return {**job, **line} if line else dict(job)
