"""Input lines -> self-contained queue entries, or an error naming line and column.

Two line formats (docs/input.md):

- native: ``{"id"?, "prompt" | "messages", <sampling params>?, "metadata"?}``
- OpenAI batch: ``{"custom_id", "method": "POST", "url", "body"}`` where ``url`` is
  ``/v1/chat/completions`` (``body.messages``), ``/v1/completions``
  (``body.prompt``) or ``/v1/embeddings`` (``body.input``); ``custom_id`` becomes
  the row id.
- native embedding: ``{"input", "task": "embed", "dimensions"?, "id"?, "metadata"?}``

Unknown fields are errors (a typo such as ``max_token`` would otherwise be
silently ignored). An OpenAI body's dialect (fields accepted and ignored, fields
refused as not supported, chat's logprobs) is ``openai_body``'s.

A line becomes a ``QueuedRequest`` (jobs/schema/entry.py): the prompt or messages, every
sampling parameter (job defaults merged with the line's own; a max_tokens neither gives
is ``sampling.default_max_tokens``'s: 16 for a prompt, null for chat), id and metadata,
so a worker needs nothing else.
"""

from __future__ import annotations

import difflib
import json
from typing import Any

from batchgen.jobs.intake import jsonpos, strictjson, tool_fields
from batchgen.jobs.intake.embeddings import BODY_FIELDS as EMBEDDING_BODY_FIELDS
from batchgen.jobs.intake.embeddings import body_request as embedding_body
from batchgen.jobs.intake.embeddings import dimensions as embedding_dimensions
from batchgen.jobs.intake.embeddings import embedding_input
from batchgen.jobs.intake.lines import MAX_LINE_BYTES as MAX_LINE_BYTES  # submit's default limit
from batchgen.jobs.intake.lines import LineError
from batchgen.jobs.intake.openai_body import FIELDS as BODY_FIELDS
from batchgen.jobs.intake.openai_body import PARAMS, body_params
from batchgen.jobs.intake.tool_fields import TOOL_FIELDS
from batchgen.jobs.schema import chat_template
from batchgen.jobs.schema.entry import QueuedRequest, compact_json
from batchgen.jobs.schema.errors import (
    BodyError,
    EmbeddingError,
    FieldError,
    JSONLineError,
    ParamError,
)
from batchgen.jobs.schema.sampling import CHECKS, check_together, default_max_tokens

MAX_ID_CHARS = 1024
MAX_METADATA_BYTES = 64 << 10
MAX_MESSAGES = 10_000
ROLES = ("system", "developer", "user", "assistant", "tool")
BASE_FIELDS = ("role", "content", "name")
# a message's fields by role (an assistant's tool calls, a tool result's call id)
MESSAGE_FIELDS = {"assistant": (*BASE_FIELDS, "tool_calls"), "tool": (*BASE_FIELDS, "tool_call_id")}

NATIVE_FIELDS = frozenset(
    {"id", "prompt", "messages", "metadata", "response_format", chat_template.NAME,
     *TOOL_FIELDS, *CHECKS}
)  # fmt: skip
EMBED_FIELDS = frozenset({"id", "input", "task", "dimensions", "metadata"})
OPENAI_FIELDS = frozenset({"custom_id", "method", "url", "body"})
URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}


def parse_line(
    number: int, raw: bytes, defaults: dict[str, Any], vocab_size: int | None = None
) -> bytes | LineError:
    """The request of one line's content, encoded for the queue (``QueuedRequest.encode``), or
    what is wrong with it. ``vocab_size``: the model's, when known at submit (logit_bias ids are
    checked against it; else the worker refuses an id outside it as an error row)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        column = len(raw[: exc.start].decode("utf-8", "replace")) + 1
        return LineError(number, column, f"invalid UTF-8 (byte 0x{raw[exc.start]:02x})")
    try:
        value = strictjson.loads(text)
    except JSONLineError as exc:
        return LineError(number, exc.column, exc.message)
    try:
        if not isinstance(value, dict):
            raise FieldError((), "a line must be a JSON object")
        is_openai = bool(OPENAI_FIELDS & value.keys())
        kind = _openai if is_openai else _native
        request = kind(value, defaults, len(text), vocab_size)
    except FieldError as exc:
        column = jsonpos.value_position(text, exc.path, key=exc.at_key)
        row_id = None  # kept on its error row: a line that is no object has none
        if isinstance(value, dict):
            row_id = given_id(value, "custom_id" if OPENAI_FIELDS & value.keys() else "id")
        return LineError(number, column, exc.message, row_id)
    del text  # encoding holds up to three copies of the prompt; the text need not be a fourth
    try:
        return request.encode()
    except UnicodeEncodeError:
        # JSON escapes can smuggle lone surrogates, which no UTF-8 encoder accepts.
        column = jsonpos.lone_surrogate(raw.decode("utf-8")) + 1
        return LineError(number, column, "unpaired surrogate escape (not valid Unicode)")


def native_entry(
    value: dict[str, Any], defaults: dict[str, Any], vocab_size: int | None = None
) -> bytes:
    """A native request given as values (a table row's), encoded for the queue, with
    the checks a native line gets; FieldError, whose path names the field."""
    return _native(value, defaults, 0, vocab_size).encode()


def _native(
    value: dict[str, Any], defaults: dict[str, Any], line_chars: int, vocab_size: int | None
) -> QueuedRequest:
    if "task" in value or "input" in value:
        return _native_embedding(value, line_chars)
    _reject_unknown(value, NATIVE_FIELDS, ())
    request = QueuedRequest()
    if "id" in value:
        request.id = _row_id(value["id"], ("id",))
    has_prompt, has_messages = "prompt" in value, "messages" in value
    if has_prompt == has_messages:
        raise FieldError((), 'give exactly one of "prompt" or "messages"')
    if has_prompt:
        request.prompt = _prompt(value["prompt"], ("prompt",))
    else:
        request.messages = _messages(value["messages"], ("messages",))
    own = value.get(chat_template.NAME)
    line_kwargs = _line_template_kwargs(own, (chat_template.NAME,), has_messages)
    request.template_kwargs = _template_kwargs(line_kwargs, defaults, has_messages)
    given = {k: v for k, v in value.items() if k in CHECKS}
    paths: dict[str, tuple[str, ...]] = {}
    tool_fields.response_format(value, given, paths, ())
    tool_fields.apply_tools(value, request, given, paths, ())
    request.sampling = _params(given, defaults, has_messages, (), paths, vocab_size)
    if "metadata" in value:
        request.metadata = _metadata(value["metadata"], ("metadata",), line_chars)
    return request


def _native_embedding(value: dict[str, Any], line_chars: int) -> QueuedRequest:
    """``{"input", "task": "embed", "dimensions"?, "id"?, "metadata"?}``."""
    _reject_unknown(value, EMBED_FIELDS, ())
    if value.get("task") != "embed":
        raise FieldError(
            ("task",) if "task" in value else (), 'an "input" line needs "task": "embed"'
        )
    if "input" not in value:
        raise FieldError((), '"task": "embed" needs "input"')
    try:
        request = QueuedRequest(embed=embedding_input(value["input"]))
        if "dimensions" in value:
            request.dimensions = embedding_dimensions(value["dimensions"])
    except EmbeddingError as exc:
        raise FieldError((exc.field,), exc.message) from None
    if "id" in value:
        request.id = _row_id(value["id"], ("id",))
    if "metadata" in value:
        request.metadata = _metadata(value["metadata"], ("metadata",), line_chars)
    return request


def _openai(
    value: dict[str, Any], defaults: dict[str, Any], line_chars: int, vocab_size: int | None
) -> QueuedRequest:
    _reject_unknown(value, OPENAI_FIELDS, ())
    for name in ("custom_id", "method", "url", "body"):
        if name not in value:
            raise FieldError((), f'OpenAI batch line without "{name}"')
    row_id = _row_id(value["custom_id"], ("custom_id",), text_only=True)
    if value["method"] != "POST":
        shown = json.dumps(value["method"])[:60]  # a method name, unless hostile
        raise FieldError(("method",), f'method must be "POST", got {shown}')
    kind = URLS.get(value["url"]) if isinstance(value["url"], str) else None
    if kind is None:
        raise FieldError(("url",), f"url must be one of {', '.join(URLS)}")
    body = value["body"]
    if not isinstance(body, dict):
        raise FieldError(("body",), "body must be an object")
    if kind == "input":
        _reject_unknown(body, EMBEDDING_BODY_FIELDS, ("body",))
        try:
            request = embedding_body(body)
        except EmbeddingError as exc:
            raise FieldError(("body", exc.field), exc.message) from None
        request.id = row_id
        return request
    _reject_unknown(body, BODY_FIELDS, ("body",))
    other = "prompt" if kind == "messages" else "messages"
    if other in body:
        raise FieldError(("body", other), f"{value['url']} takes body.{kind}, not body.{other}")
    if kind not in body:
        raise FieldError(("body",), f"{value['url']} needs body.{kind}")
    request = QueuedRequest(id=row_id)
    if kind == "prompt":
        request.prompt = _prompt(body["prompt"], ("body", "prompt"))
    else:
        request.messages = _messages(body["messages"], ("body", "messages"))
    chat = kind == "messages"
    own = body.get(chat_template.NAME)
    line_kwargs = _line_template_kwargs(own, ("body", chat_template.NAME), chat)
    if "reasoning_effort" in body:
        path = ("body", "reasoning_effort")
        if not chat:
            raise FieldError(path, f"{value['url']} has no chat template for reasoning_effort")
        try:
            effort = chat_template.reasoning_effort(body["reasoning_effort"])
        except ParamError as exc:
            raise FieldError(path, str(exc)) from None
        line_kwargs = {**(line_kwargs or {}), "reasoning_effort": effort}
    request.template_kwargs = _template_kwargs(line_kwargs, defaults, chat)
    try:
        params = body_params(body, chat=chat)
    except BodyError as exc:
        raise FieldError(("body", exc.field), exc.message, exc.at_key) from None
    paths: dict[str, tuple[str, ...]] = {
        name: ("body", key) for key, name in PARAMS.items() if key in body
    }
    paths["logprobs"] = ("body", "top_logprobs" if "top_logprobs" in body else "logprobs")
    tool_fields.response_format(body, params, paths, ("body",))
    tool_fields.apply_tools(body, request, params, paths, ("body",))
    request.sampling = _params(params, defaults, chat, ("body",), paths, vocab_size)
    if "metadata" in body:
        request.metadata = _metadata(body["metadata"], ("body", "metadata"), line_chars)
    return request


def _line_template_kwargs(value: Any, path: tuple[str, ...], chat: bool) -> dict[str, Any] | None:
    """A line's own chat_template_kwargs (None: not given)."""
    if value is None:
        return None
    if not chat:
        raise FieldError(path, f"{path[-1]} needs messages: a prompt is not rendered by the "
                         "chat template")  # fmt: skip
    try:
        return chat_template.check(value)
    except ParamError as exc:
        raise FieldError(path, str(exc)) from None


def _template_kwargs(
    line: dict[str, Any] | None, defaults: dict[str, Any], chat: bool
) -> dict[str, Any] | None:
    """What a line's chat template renders with: the job's variables, its own over them
    (a prompt line has none: it is not rendered by the template)."""
    return chat_template.merged(defaults.get(chat_template.NAME), line) if chat else None


def _reject_unknown(value: dict[str, Any], allowed: frozenset[str], at: tuple[str, ...]) -> None:
    if value.keys() <= allowed:
        return
    for key in value:
        if key not in allowed:
            # difflib indexes each character of the key: a hint only for name-sized keys
            close = difflib.get_close_matches(key, sorted(allowed), n=1) if len(key) < 64 else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = strictjson.clip(".".join((*at, key)))
            raise FieldError((*at, key), f"unknown field {where}{hint}", at_key=True)


def given_id(value: dict[str, Any], key: str) -> str | None:
    """The id an invalid line or row carried, kept on its error row; None if it had none
    or the id itself is what is wrong."""
    try:
        return _row_id(value[key], (key,), text_only=key == "custom_id") if key in value else None
    except FieldError:
        return None


def _row_id(value: Any, path: tuple[str, ...], text_only: bool = False) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and not text_only:
        return str(value)
    if not isinstance(value, str) or not value:
        kind = "a non-empty string" if text_only else "a non-empty string or an integer"
        raise FieldError(path, f"{path[-1]} must be {kind}")
    if len(value) > MAX_ID_CHARS:
        raise FieldError(path, f"{path[-1]} is longer than {MAX_ID_CHARS} characters")
    return value


def _prompt(value: Any, path: tuple[str, ...]) -> str:
    if isinstance(value, list):
        raise FieldError(path, "prompt must be one string (one prompt per line)")
    if not isinstance(value, str):
        raise FieldError(path, "prompt must be a string")
    if not value:
        raise FieldError(path, "prompt is empty")
    return value


def _messages(value: Any, path: tuple[str, ...]) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise FieldError(path, "messages must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        raise FieldError(path, f"more than {MAX_MESSAGES} messages")
    out = []
    for i, message in enumerate(value):
        at: tuple[str | int, ...] = (*path, i)
        if not isinstance(message, dict):
            raise FieldError(at, "each message must be an object with role and content")
        role = message.get("role")
        allowed = MESSAGE_FIELDS.get(role, BASE_FIELDS) if isinstance(role, str) else BASE_FIELDS
        for key in message:
            if key not in allowed:
                raise FieldError(
                    (*at, key), f"unknown message field {strictjson.clip(key)}", at_key=True
                )
        if role not in ROLES:
            raise FieldError((*at, "role"), f"role must be one of {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        if "content" not in message and not calls:
            raise FieldError(at, "message without content")
        content = message.get("content")
        normalized: dict[str, Any] = {
            "role": role,
            "content": "" if content is None and calls else _content(content, (*at, "content")),
        }
        if "name" in message:
            if not isinstance(message["name"], str):
                raise FieldError((*at, "name"), "name must be a string")
            normalized["name"] = message["name"]
        if calls is not None:
            normalized["tool_calls"] = tool_fields.message_calls(calls, (*at, "tool_calls"))
        if "tool_call_id" in message:
            if not isinstance(message["tool_call_id"], str):
                raise FieldError((*at, "tool_call_id"), "tool_call_id must be a string")
            normalized["tool_call_id"] = message["tool_call_id"]
        out.append(normalized)
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise FieldError(path, "every message is empty")
    return out


def _content(value: Any, path: tuple[str | int, ...]) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise FieldError((*path, i), 'only {"type": "text"} content parts are supported')
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise FieldError((*path, i), 'a text part is {"type": "text", "text": "..."}')
            texts.append(part["text"])
        return "".join(texts)
    raise FieldError(path, "content must be a string or a list of text parts")


def _params(
    given: dict[str, Any],
    defaults: dict[str, Any],
    chat: bool,
    at: tuple[str, ...],
    paths: dict[str, tuple[str, ...]] | None = None,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    # max_tokens first, where the job's defaults always put it: a prompt line's bytes stay
    # as the releases before wrote them
    merged = {"max_tokens": default_max_tokens(chat), **defaults}
    merged.pop(chat_template.NAME, None)  # the job's chat template variables: not sampling
    paths = paths or {}
    for name, value in given.items():
        try:
            merged[name] = CHECKS[name](name, value)  # params.check, one call less a field
        except ParamError as exc:
            raise FieldError(paths.get(name, (*at, name)), str(exc)) from None
    bias = merged.get("logit_bias")
    if bias and vocab_size is not None:
        outside = [token for token in bias if int(token) >= vocab_size]
        if outside:
            path = paths.get("logit_bias", (*at, "logit_bias"))
            raise FieldError(path, f"logit_bias token id {outside[0]} is outside the model's "
                              f"vocabulary [0, {vocab_size})")  # fmt: skip
    if merged.get("structured_output"):
        try:
            check_together(merged)
        except ParamError as exc:
            path = paths.get("structured_output", (*at, "structured_output"))
            raise FieldError(path if "structured_output" in given else at, str(exc)) from None
    return merged


def _metadata(value: Any, path: tuple[str, ...], line_chars: int) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FieldError(path, "metadata must be an object")
    if line_chars * 4 < MAX_METADATA_BYTES:
        return value  # re-serialized, it cannot outgrow this short a line much
    size = len(compact_json(value).encode("utf-8", "surrogatepass"))
    if size > MAX_METADATA_BYTES:
        raise FieldError(path, f"metadata is {size:,} bytes; at most {MAX_METADATA_BYTES:,}")
    return value
