"""Tools: a chat request's ``tools`` and ``tool_choice``, as OpenAI's API writes them.

``tools`` is a list of ``{"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}``; the worker renders it with the messages through the
checkpoint's chat template (``apply_chat_template(tools=...)``). ``tool_choice`` says
what the output may be:

- ``"auto"`` (the default with tools): the model decides; the job's tool-call parser
  (tool_parsers.py) finds the calls it wrote, or the row stays text.
- ``"none"``: no calls; the tools are still rendered (vLLM's default), nothing is parsed.
- ``"required"``, or ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained (constraints.py, ``forced_constraint``) to be calls whose arguments
  validate against each function's ``parameters``: for ``required`` a JSON list of
  ``{"name", "parameters"}`` (one item with ``parallel_tool_calls: false``), for a named
  function the arguments object alone, as vLLM constrains them; ``forced_calls`` reads
  the calls back. The constraint starts at the first generated token, so such a row has
  no reasoning.

A row's calls are OpenAI's ``{"id", "type": "function", "function": {"name",
"arguments"}}`` (``call_record``), arguments a JSON text.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from batchgen.jobs.schema.sampling import ParamError, show
from batchgen.jobs.schema.tool_parsers import Call, arguments_text

MODES = ("auto", "none", "required")
FORCING = ("required", "function")  # tool_choice kinds that constrain the output
MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_tools(value: Any) -> list[dict[str, Any]]:
    """``tools`` normalized to ``{"type": "function", "function": {...}}`` items with
    distinct names; ParamError naming what is wrong."""
    if not isinstance(value, list) or not value:
        raise ParamError(f'tools must be a non-empty list of {{"type": "function", "function": '
                         f"{{...}}}} objects, got {show(value)}")  # fmt: skip
    if len(value) > MAX_TOOLS:
        raise ParamError(f"tools lists {len(value)} functions; at most {MAX_TOOLS}")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {
            "type", "function"
        }:  # fmt: skip
            raise ParamError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ParamError(f"tools[{i}].function must be an object with a name")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise ParamError(f"tools[{i}].function has unknown field {sorted(unknown)[0]!r}")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ParamError(f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                             f"_, ., : or -, got {show(name)}")  # fmt: skip
        if name in seen:
            raise ParamError(f"tools name the function {name!r} twice")
        seen.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ParamError(f"tools[{i}].function.description must be a string")
        if not isinstance(function.get("parameters", {}), dict):
            raise ParamError(f"tools[{i}].function.parameters must be a JSON Schema object")
        if not isinstance(function.get("strict", False), bool):
            raise ParamError(f"tools[{i}].function.strict must be true or false")
    return value


def check_choice(value: Any, tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    """``tool_choice`` as given (a mode, or the named function's object); ParamError for
    another value, or a function ``tools`` does not list."""
    if value in MODES:
        if tools is None and value != "none":
            raise ParamError(f"tool_choice {show(value)} needs tools")
        return str(value)
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict) or value.get("type") != "function" or set(value) != {
            "type", "function"} or not isinstance(function, dict) or set(function) != {"name"}
    ):  # fmt: skip
        raise ParamError(f'tool_choice must be "auto", "none", "required" or {{"type": '
                         f'"function", "function": {{"name": ...}}}}, got {show(value)}')  # fmt: skip
    if function["name"] not in names(tools or []):
        raise ParamError(f"tool_choice names the function {show(function['name'])}, which "
                         "tools does not list")  # fmt: skip
    return value


def names(tools: list[dict[str, Any]]) -> list[str]:
    return [tool["function"]["name"] for tool in tools]


def kind(choice: str | dict[str, Any] | None) -> str:
    """``auto``, ``none``, ``required`` or ``function`` (a named function)."""
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else "function"


def _parameters(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    function = next(t["function"] for t in tools if t["function"]["name"] == name)
    return function.get("parameters") or ANY_OBJECT


def forced_constraint(
    tools: list[dict[str, Any]], choice: str | dict[str, Any], parallel: bool = True
) -> dict[str, Any] | None:
    """The structured_output (a ``json`` schema) that ``required`` or a named function
    puts on the output; None for ``auto`` and ``none``."""
    if kind(choice) == "function":
        assert isinstance(choice, dict)
        return {"json": _parameters(tools, choice["function"]["name"])}
    if choice != "required":
        return None
    calls = [{"type": "object", "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": _parameters(tools, name)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name in names(tools)]  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {"json": schema}


def forced_calls(text: str, choice: str | dict[str, Any]) -> list[Call] | None:
    """The calls of an output made under ``forced_constraint``; None when it is not
    complete (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if kind(choice) == "function":
        assert isinstance(choice, dict)
        arguments = arguments_text(value)
        return None if arguments is None else [Call(choice["function"]["name"], arguments)]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = arguments_text(item.get("parameters"))
        if arguments is None:
            return None
        calls.append(Call(item["name"], arguments))
    return calls


def call_record(
    call: Call, job_id: str, index: int, position: int, sample: int = 0
) -> dict[str, Any]:
    """A call as a row's ``tool_calls`` item (of its ``sample`` with n > 1); its id is the
    same on every run of the row."""
    where = f"{job_id}/{index}/{position}" + (f"/{sample}" if sample else "")
    digest = hashlib.blake2b(where.encode(), digest_size=12).hexdigest()
    return {"id": f"call_{digest}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}  # fmt: skip


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's tool call arguments that hold
    a JSON object become that object (templates write ``arguments | tojson``), as vLLM
    passes them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_template_call(c) for c in calls]}
        out.append(message)
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"].get("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            return {**call, "function": {**call["function"], "arguments": parsed}}
    return call
