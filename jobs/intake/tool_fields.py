"""A line's fields that become its structured_output (OpenAI's ``response_format``; ``tools``,
``tool_choice`` and ``parallel_tool_calls``, where a forced call constrains the output), and
an assistant message's ``tool_calls`` in a multi-turn input (jobs/schema/tools.py: the
tools themselves)."""

from __future__ import annotations

from typing import Any

from batchgen.jobs.schema import tools
from batchgen.jobs.schema.constraints import check_spec, from_response_format
from batchgen.jobs.schema.entry import QueuedRequest
from batchgen.jobs.schema.errors import FieldError, ParamError
from batchgen.jobs.schema.sampling import show

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def apply_tools(
    value: dict[str, Any], request: QueuedRequest, given: dict[str, Any],
    paths: dict[str, tuple[str, ...]], at: tuple[str, ...],
) -> None:  # fmt: skip
    """A chat line's tools and tool_choice onto its request; ``required`` or a named
    function as the structured_output that makes every output a valid call."""
    present = [name for name in TOOL_FIELDS if name in value]
    if not present:
        return
    if request.messages is None:
        raise FieldError((*at, present[0]), f"{present[0]} needs messages: a prompt is not "
                         "rendered by the chat template")  # fmt: skip
    try:
        if "tools" in value:
            request.tools = tools.check_tools(value["tools"])
    except ParamError as exc:
        raise FieldError((*at, "tools"), str(exc)) from None
    choice_path = (*at, "tool_choice")
    try:
        if "tool_choice" in value:
            request.tool_choice = tools.check_choice(value["tool_choice"], request.tools)
    except ParamError as exc:
        raise FieldError(choice_path, str(exc)) from None
    parallel = value.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise FieldError((*at, "parallel_tool_calls"), "parallel_tool_calls must be true or "
                         f"false, got {show(parallel)}")  # fmt: skip
    if request.tools is None or request.tool_choice is None:
        return
    forced = tools.forced_constraint(request.tools, request.tool_choice, parallel)
    if forced is None:
        return
    if given.get("structured_output"):
        raise FieldError(choice_path, f"tool_choice {tools.kind(request.tool_choice)} "
                         "constrains the output to a call: give no response_format or "
                         "structured_output with it")  # fmt: skip
    try:
        given["structured_output"] = check_spec(forced)
    except ParamError as exc:
        raise FieldError((*at, "tools"), f"a function's parameters cannot constrain the "
                         f"output: {exc}") from None  # fmt: skip
    paths["structured_output"] = choice_path


def message_calls(value: Any, path: tuple[str | int, ...]) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, as a row's tool_calls column writes them."""
    shape = (
        'tool_calls must be a list of {"id", "type": "function", "function": {"name", "arguments"}}'
    )
    if not isinstance(value, list):
        raise FieldError(path, shape)
    out = []
    for i, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict) or call.get("type", "function") != "function"
            or set(call) - {"id", "type", "function"} or not isinstance(function, dict)
            or set(function) - {"name", "arguments"} or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments", ""), str)
            or not isinstance(call.get("id", ""), str)
        ):  # fmt: skip
            raise FieldError((*path, i), shape + " (arguments a JSON string)")
        out.append({**call, "type": "function"})
    return out


def response_format(
    value: dict[str, Any], given: dict[str, Any], paths: dict[str, tuple[str, ...]],
    at: tuple[str, ...],
) -> None:  # fmt: skip
    """OpenAI's response_format, as the structured_output it means."""
    if "response_format" not in value:
        return
    path = (*at, "response_format")
    if "structured_output" in value:
        raise FieldError(path, "give response_format or structured_output, not both")
    try:
        given["structured_output"] = from_response_format(value["response_format"])
    except ParamError as exc:
        raise FieldError(path, str(exc)) from None
    paths["structured_output"] = path
