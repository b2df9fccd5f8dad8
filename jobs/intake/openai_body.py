"""The body of an OpenAI batch line, as clients really write it.

Which body fields are sampling parameters (and under which name), which are
accepted and ignored once their value is checked (clients set them by default),
and which are refused as "not supported by batchgen" rather than as unknown.
The prompt, messages, metadata, response_format, the chat template variables
(``chat_template_kwargs``, ``reasoning_effort``) and the tools (``tools``,
``tool_choice``, ``parallel_tool_calls``) are ``inputs``' business.
"""

from __future__ import annotations

from typing import Any

from batchgen.jobs.schema.errors import BodyError, ParamError
from batchgen.jobs.schema.sampling import CHECKS, show

# body field -> sampling parameter ("logprobs" means different things in chat and completions)
PARAMS = {name: name for name in CHECKS if name != "logprobs"} | {
    "max_completion_tokens": "max_tokens"
}
# accepted and ignored; the value must still have the right type
IGNORED: dict[str, type] = {
    "model": str,  # the job's --model decides
    "user": str,
    "store": bool,
    "service_tier": str,
}
# only these values mean what batchgen does; any other is not supported
FIXED: dict[str, Any] = {"stream": False, "echo": False, "suffix": None}
UNSUPPORTED = frozenset(
    {"functions", "function_call", "audio", "modalities", "prediction", "web_search_options"}
)  # fmt: skip
# chat template variables (vLLM's body field, and OpenAI's reasoning_effort for gpt-oss),
# and the tools the template renders
OWN = frozenset({"messages", "prompt", "metadata", "response_format", "chat_template_kwargs",
                 "reasoning_effort", "tools", "tool_choice", "parallel_tool_calls"})  # fmt: skip
FIELDS = frozenset(
    {*PARAMS, *IGNORED, *FIXED, *UNSUPPORTED, *OWN, "logprobs", "top_logprobs", "best_of"}
)


def body_params(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The sampling parameters a body sets (unchecked values, by parameter name).

    Raises BodyError for a refused field or a wrong value of an ignored one.
    ``body``'s keys must already be known (``FIELDS``).
    """
    for key in body:
        if key in UNSUPPORTED:
            raise BodyError(key, f"body.{key} is not supported by batchgen", at_key=True)
        if key in FIXED and body[key] != FIXED[key]:
            raise BodyError(key, f"body.{key} = {show(body[key])} is not supported by batchgen "
                            f"(only {show(FIXED[key])})")  # fmt: skip
        if key in IGNORED and not isinstance(body[key], IGNORED[key]):
            kind = "a string" if IGNORED[key] is str else "true or false"
            raise BodyError(key, f"body.{key} must be {kind}, got {show(body[key])}")
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise BodyError(
            "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
        )
    params = {PARAMS[k]: v for k, v in body.items() if k in PARAMS}
    if "best_of" in body and body["best_of"] != body.get("n", 1):
        raise BodyError("best_of", f"best_of must equal n (batchgen returns every sample), "
                        f"got {show(body['best_of'])}")  # fmt: skip
    logprobs = _chat_logprobs(body) if chat else body.get("logprobs")
    if logprobs is not None:
        params["logprobs"] = logprobs
    return params


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's ``logprobs: true`` + ``top_logprobs: K`` as the native ``logprobs: K``."""
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise BodyError("logprobs", f"body.logprobs must be true or false, got {show(wanted)}")
    top = body.get("top_logprobs")
    if top is not None:
        if not wanted:
            raise BodyError("top_logprobs", "top_logprobs needs logprobs: true")
        try:
            return CHECKS["logprobs"]("top_logprobs", top)
        except ParamError as exc:
            raise BodyError("top_logprobs", str(exc)) from None
    return 0 if wanted else None
