"""The queue entry: what submit writes to a model's stream and what a worker reads back.

A stream entry is these fields, and this module is the only code that names them
(the Lua scripts that append entries take the names from ``LUA_FIELDS``)::

    j  the job id
    i  the input's index (0-based over the lines or rows, invalid ones included)
    r  the request (``QueuedRequest``): compact UTF-8 JSON with short keys
    q  when the request was queued (unix ms), on an entry dispatched from a job's backlog
       (a handed-back or retried entry carries it in ``x``)
    x  on an entry a worker handed back, or a retried request's: what it carries to the
       next worker (JSON)

Submit does not write entries to the stream itself: it appends each request to its
job's backlog (backlog.py) as one string, ``INDEX WHEN REQUEST`` (``backlog_item``), and
the dispatch script (worker/consumer/dispatch.py) makes the entry from it when a worker has room for it:
``j i r q`` when WHEN is the queued ms, ``j i r x`` when it is the ``x`` of a request
that ran before (``{"a":RUNS,"q":QUEUED_MS}``: a retry queues its rows so, and their
rows count the earlier deliveries in ``attempts``).

Inside ``r``: ``id`` the row id, ``p`` prompt | ``m`` messages | ``e`` embedding input,
``dim`` dimensions, ``s`` sampling parameters (named as in ``sampling.FIELDS``: the job's
defaults merged with the line's own), ``ct`` a chat line's chat template variables (the
job's merged with the line's own, chat_template.py), ``tl`` its tools and ``tc`` its
tool_choice (tools.py), ``md`` metadata; a worker needs
nothing else. An
invalid line submitted with ``--skip-invalid`` is an entry too, so its row keeps its
place: ``err`` (written first) says what is wrong with it, and its row is that error.
The keys are short because a stream holds millions of entries, and the bytes stay the
same from release to release because a job's fingerprint is their sha256 (a resumed
submit and a retry must make the bytes the submit before them made).

Inside ``x``: ``resume`` the tokens generated so far, ``a`` deliveries that ran it
before (a retried row's earlier rounds included), ``f`` how many of those ended in a
crash (in this round: a retry starts them at 0), ``q`` when it was first queued (unix
ms), ``pre`` preemptions, ``err`` the last engine error, ``row`` its finished row whose
part could not be written.

Versions: every release so far writes format 1, which has no ``v`` field. A later
format adds ``v``; a reader refuses a format it does not know rather than misread it,
and an entry without its queue time (``q``, or ``x``'s ``q``) like one without ``j``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from json.encoder import c_make_encoder, encode_basestring  # type: ignore[attr-defined]
from typing import Any, TypeVar

from batchgen.jobs.schema.errors import EntryError
from batchgen.jobs.schema.rows import Row, from_dict

FORMAT = 1  # the entry format this release reads and writes

_JOB, _INDEX, _REQUEST, _QUEUED, _CARRIED = "j", "i", "r", "q", "x"
# as XRANGE returns the names (decoding reads every entry a worker runs); "v": the format
_JOB_B, _INDEX_B, _REQUEST_B, _QUEUED_B, _CARRIED_B, _FORMAT_B = b"j", b"i", b"r", b"q", b"x", b"v"
# For the Lua script that makes entries itself (worker/consumer/dispatch.py).
LUA_FIELDS = (
    f"local F = {{job = '{_JOB}', index = '{_INDEX}', request = '{_REQUEST}', "
    f"queued = '{_QUEUED}', carried = '{_CARRIED}'}}\n"
)

_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False)
# JSONEncoder.encode builds this C encoder anew for every call, a tenth of a line's
# validation: built once here (entries hold dicts, lists, strings and numbers, no
# cycles). Same bytes either way.
_C_ENCODER = c_make_encoder and c_make_encoder(
    None, _ENCODER.default, encode_basestring, None, ":", ",", False, False, True
)


def compact_json(value: Any) -> str:
    """``value`` as entries write JSON: no spaces, text as itself (not ASCII escapes)."""
    return "".join(_C_ENCODER(value, 0)) if _C_ENCODER else _ENCODER.encode(value)


def backlog_item(index: int, queued_ms: int, request: bytes, prior_runs: int = 0) -> bytes:
    """A request as its job's backlog holds it: ``INDEX WHEN REQUEST`` (worker/consumer/dispatch.py splits
    it at the first two spaces; the request is compact JSON). WHEN is ``QUEUED_MS``, or for
    a request that ``prior_runs`` deliveries ran before (a retried row's), the ``x`` its
    entry carries, which counts them: compact JSON of numbers, so it holds no space."""
    if not prior_runs:
        return b"%d %d " % (index, queued_ms) + request
    carried = compact_json({"a": prior_runs, "q": queued_ms}).encode()
    return b"%d %s " % (index, carried) + request


def parse_backlog_item(item: bytes) -> tuple[int, int, bytes]:
    """(index, queued ms, request) of a ``backlog_item``."""
    index, when, request = item.split(b" ", 2)
    queued_ms = int(json.loads(when)["q"]) if when.startswith(b"{") else int(when)
    return int(index), queued_ms, request


@dataclass(slots=True)
class QueuedRequest:
    """What one input line or row asks for: exactly one of ``prompt``, ``messages`` or
    ``embed``. None is absent, and not written."""

    id: str | None = None  # the row id (a line's id or custom_id)
    prompt: str | None = None
    # {role, content, name?} each; an assistant's tool_calls, a tool's tool_call_id
    messages: list[dict[str, Any]] | None = None
    embed: str | list[int] | None = None  # an embedding line's one input: text or token ids
    dimensions: int | None = None  # the embedding's length, when truncated
    sampling: dict[str, Any] | None = None  # sampling.FIELDS name -> value; None: embedding
    metadata: dict[str, Any] | None = None  # the line's own, returned with its row
    invalid: str | None = None  # an invalid line's error (--skip-invalid): its row is that
    template_kwargs: dict[str, Any] | None = None  # chat template variables (messages only)
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template (tools.py)
    tool_choice: str | dict[str, Any] | None = None  # None: auto (with tools)

    @classmethod
    def rejected(cls, error: str, row_id: str | None = None) -> QueuedRequest:
        """The entry of an invalid line or row: it runs nothing, its row is the error."""
        return cls(id=row_id, invalid=error)

    @property
    def prompt_input(self) -> str | list[dict[str, Any]] | None:
        """What the engine tokenizes to generate from: the prompt or the chat messages."""
        return self.prompt if self.prompt is not None else self.messages

    def param(self, name: str, default: Any = None) -> Any:
        """A sampling parameter as the line or the job's defaults set it, else ``default``."""
        return self.sampling.get(name, default) if self.sampling else default

    def encode(self) -> bytes:
        """The ``r`` field. UnicodeEncodeError for a lone surrogate (no UTF-8 holds one)."""
        # written out, not a loop over the keys: submit encodes every line (a tenth faster)
        wire: dict[str, Any] = {}
        if self.invalid is not None:  # first: is_rejected reads the entry's first bytes
            wire["err"] = self.invalid
        if self.id is not None:
            wire["id"] = self.id
        if self.prompt is not None:
            wire["p"] = self.prompt
        if self.messages is not None:
            wire["m"] = self.messages
        if self.embed is not None:
            wire["e"] = self.embed
        if self.dimensions is not None:
            wire["dim"] = self.dimensions
        if self.sampling is not None:
            wire["s"] = self.sampling
        if self.template_kwargs is not None:
            wire["ct"] = self.template_kwargs
        if self.tools is not None:
            wire["tl"] = self.tools
        if self.tool_choice is not None:
            wire["tc"] = self.tool_choice
        if self.metadata is not None:
            wire["md"] = self.metadata
        return compact_json(wire).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes | str) -> QueuedRequest:
        wire = json.loads(raw)
        if not isinstance(wire, dict):
            raise EntryError("the request is not a JSON object")
        get = wire.get
        return cls(get("id"), get("p"), get("m"), get("e"), get("dim"), get("s"), get("md"),
                   get("err"), get("ct"), get("tl"), get("tc"))  # fmt: skip


def is_rejected(encoded: bytes) -> bool:
    """Whether an encoded request (``QueuedRequest.encode``) is an invalid line's entry."""
    return encoded.startswith(b'{"err":')


E = TypeVar("E", bound="QueueEntry")


@dataclass(slots=True)
class QueueEntry:
    """One stream entry: a job's request at an input index, and what the workers that
    ran it before handed back with it."""

    job_id: str
    index: int
    request: QueuedRequest
    resume: list[int] = field(default_factory=list)  # tokens generated by earlier workers
    prior_runs: int = 0  # deliveries of the entries it was handed back from
    prior_failures: int = 0  # of those, the ones that ended in a crash (not a hand-back)
    queued_at: int = 0  # unix ms the request was first enqueued
    preemptions: int = 0  # before the hand-back
    last_error: str = ""  # why the engine failed the last time it ran this
    finished: Row | None = None  # its row, made before storage failed: only its part is missing

    def request_fields(self) -> list[str]:
        """Name, value, ... of the request alone (what a dead letter keeps)."""
        request = self.request.encode().decode("utf-8")
        return [_JOB, self.job_id, _INDEX, str(self.index), _REQUEST, request]

    def handed_back_fields(self) -> list[str]:
        """Name, value, ... of the entry as a worker hands it back, with what it carries."""
        carried: dict[str, Any] = {"resume": self.resume, "a": self.prior_runs,
                                   "f": self.prior_failures, "q": self.queued_at,
                                   "pre": self.preemptions}  # fmt: skip
        if self.last_error:
            carried["err"] = self.last_error
        if self.finished is not None:
            carried["row"] = self.finished.to_dict()
        return [*self.request_fields(), _CARRIED, compact_json(carried)]

    @classmethod
    def decode(cls: type[E], fields: Mapping[bytes, bytes], stream_id: str, **more: Any) -> E:
        """The entry the stream holds as ``stream_id``; ``more``: a subclass's own fields.
        EntryError when it cannot be read."""
        try:
            version = fields.get(_FORMAT_B)
            if version is not None and int(version) != FORMAT:
                raise EntryError(f"it has format {int(version)}; this release reads format "
                                 f"{FORMAT} (upgrade it)")  # fmt: skip
            job_id = fields[_JOB_B].decode()
            index = int(fields[_INDEX_B])
            request = QueuedRequest.decode(fields[_REQUEST_B])
            raw_carried = fields.get(_CARRIED_B)
            if not raw_carried:  # as dispatched from a backlog (most entries): nothing carried
                if _QUEUED_B not in fields:
                    raise EntryError(f"it has no {_QUEUED!r} field (when it was queued)")
                queued_at = int(fields[_QUEUED_B])
                return cls(job_id=job_id, index=index, request=request, queued_at=queued_at, **more)
            carried = json.loads(raw_carried)
            if not isinstance(carried, dict):
                raise EntryError(f"its {_CARRIED!r} field is not a JSON object")
            if "q" not in carried:
                raise EntryError(f"its {_CARRIED!r} field has no 'q' (when it was first queued)")
            row = carried.get("row")
            return cls(
                job_id=job_id,
                index=index,
                request=request,
                resume=list(carried.get("resume", ())),
                prior_runs=int(carried.get("a", 0)),
                prior_failures=int(carried.get("f", 0)),
                queued_at=int(carried["q"]),
                preemptions=int(carried.get("pre", 0)),
                last_error=str(carried.get("err", "")),
                finished=from_dict(row) if isinstance(row, dict) else None,
                **more,
            )
        except (KeyError, ValueError, TypeError, AttributeError, RecursionError) as exc:
            raise EntryError(f"stream entry {stream_id} cannot be read: {exc}") from None


def job_and_index(fields: Mapping[bytes, bytes]) -> tuple[str, int] | None:
    """The job id and input index of an entry whose request cannot be read, when those two
    fields can (where its error row goes); None when they cannot."""
    try:
        job_id, index = fields[_JOB_B].decode(), int(fields[_INDEX_B])
    except (KeyError, ValueError, TypeError, AttributeError):
        return None
    return (job_id, index) if job_id and index >= 0 else None


def job_of(fields: Mapping[bytes, bytes]) -> bytes | None:
    """The job id of a raw stream entry, its request left unread."""
    return fields.get(_JOB_B)
