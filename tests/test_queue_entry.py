"""The queue entry (jobs/schema/entry.py): one codec, its bytes stable across releases,
entries written by the release before it still read, every field round-trips."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import given, settings

from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.redis.keys import Keys
from batchgen.jobs.redis.stream import ensure_group
from batchgen.jobs.schema.entry import QueuedRequest, QueueEntry
from batchgen.jobs.schema.errors import EntryError
from batchgen.jobs.schema.rows import FinishReason, Row
from batchgen.jobs.schema.sampling import DEFAULTS
from batchgen.worker.consumer.queue import Delivery, HandBack, dead_letter, hand_back, read_new

QK = Keys("bg").queue_for_model("m")
S16 = {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, "top_k": 0}

# Input lines and the exact ``r`` bytes the release before this module made of them
# (captured from its parse_line): a job's fingerprint is their sha256, so a resumed
# submit or a retry of a job submitted before an upgrade must make the same bytes. One
# change on purpose: a chat line without max_tokens runs to its end (null), not 16 tokens.
LINES_AND_BYTES = [
    ({"id": "row-1", "prompt": "Tell me about café ☕", "max_tokens": 64, "temperature": 0.7,
      "top_p": 0.9, "seed": 7, "stop": ["\n\n"], "logit_bias": {"50256": -100}, "logprobs": 2,
      "n": 2, "metadata": {"user": "ü", "n": 3}},
     b'{"id":"row-1","p":"Tell me about caf\xc3\xa9 \xe2\x98\x95","s":{"max_tokens":64,'
     b'"temperature":0.7,"top_p":0.9,"top_k":0,"seed":7,"stop":["\\n\\n"],"logit_bias":'
     b'{"50256":-100.0},"logprobs":2,"n":2},"md":{"user":"\xc3\xbc","n":3}}'),
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "bob"}]},
     b'{"m":[{"role":"system","content":"Be brief."},{"role":"user","content":"hi",'
     b'"name":"bob"}],"s":{"max_tokens":null,"temperature":0.0,"top_p":1.0,"top_k":0}}'),
    ({"prompt": "json please", "response_format": {"type": "json_object"}},
     b'{"p":"json please","s":{"max_tokens":16,"temperature":0.0,"top_p":1.0,"top_k":0,'
     b'"structured_output":{"json_object":true}}}'),
    ({"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
      "body": {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
               "metadata": {"k": "v"}}},
     b'{"id":"c1","m":[{"role":"user","content":"x"}],"s":{"max_tokens":8,"temperature":0.0,'
     b'"top_p":1.0,"top_k":0},"md":{"k":"v"}}'),
    ({"custom_id": "c2", "method": "POST", "url": "/v1/completions",
      "body": {"model": "m", "prompt": "abc", "stop": "x"}},
     b'{"id":"c2","p":"abc","s":{"max_tokens":16,"temperature":0.0,"top_p":1.0,"top_k":0,'
     b'"stop":["x"]}}'),
    ({"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
      "body": {"model": "m", "input": "hello", "dimensions": 8}},
     b'{"id":"e1","e":"hello","dim":8}'),
    ({"task": "embed", "input": [1, 2, 3], "metadata": {"k": 1}},
     b'{"e":[1,2,3],"md":{"k":1}}'),
    ({"id": 42, "prompt": "p", "structured_output": {"choice": ["yes", "no"]}},
     b'{"id":"42","p":"p","s":{"max_tokens":16,"temperature":0.0,"top_p":1.0,"top_k":0,'
     b'"structured_output":{"choice":["yes","no"]}}}'),
]  # fmt: skip


@pytest.mark.parametrize(("line", "wire"), LINES_AND_BYTES)
def test_submit_writes_the_bytes_the_release_before_wrote(line: dict, wire: bytes) -> None:
    assert parse_line(1, json.dumps(line).encode(), dict(DEFAULTS)) == wire
    assert QueuedRequest.decode(wire).encode() == wire


def test_a_native_embedding_line_with_an_id_lists_the_id_first_now() -> None:
    """The one request whose key order changed (the release before wrote ``e``, ``id``,
    ``md``; OpenAI's embedding lines had ``id`` first): same keys, same size, same request."""
    before = b'{"e":[1,2,3],"id":"9","md":{"k":1}}'
    line = {"task": "embed", "input": [1, 2, 3], "id": 9, "metadata": {"k": 1}}
    now = parse_line(1, json.dumps(line).encode(), dict(DEFAULTS))
    assert now == b'{"id":"9","e":[1,2,3],"md":{"k":1}}'
    assert len(now) == len(before) and QueuedRequest.decode(before) == QueuedRequest.decode(now)


def test_requests_read_as_typed_fields() -> None:
    wire = LINES_AND_BYTES[0][1]
    assert QueuedRequest.decode(wire) == QueuedRequest(
        id="row-1", prompt="Tell me about café ☕",
        sampling={"max_tokens": 64, "temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 7,
                  "stop": ["\n\n"], "logit_bias": {"50256": -100.0}, "logprobs": 2, "n": 2},
        metadata={"user": "ü", "n": 3},
    )  # fmt: skip
    assert QueuedRequest.decode(LINES_AND_BYTES[5][1]) == QueuedRequest(
        id="e1", embed="hello", dimensions=8
    )
    assert (
        QueuedRequest.decode(b"{}") == QueuedRequest()
    )  # an empty request reads (its row is an error)


# Entries exactly as the release before this module handed them back (its hand_back,
# json.dumps with spaces and ASCII escapes), read by a worker of this release.
OLD_HANDED_BACK = {
    b"j": b"j", b"i": b"0",
    b"r": b'{"id": "row-1", "p": "Tell me about caf\\u00e9 \\u2615", "s": {"max_tokens": 64, '
          b'"temperature": 0.7, "top_p": 0.9, "top_k": 0, "seed": 7, "stop": ["\\n\\n"], '
          b'"logit_bias": {"50256": -100.0}, "logprobs": 2, "n": 2}, "md": {"user": "\\u00fc", '
          b'"n": 3}}',
    b"x": b'{"resume": [11, 12], "a": 1, "f": 1, "q": 1796169345224, "pre": 1, '
          b'"err": "RuntimeError: boom"}',
}  # fmt: skip
OLD_WITH_ROW = {
    b"j": b"j", b"i": b"1",
    b"r": b'{"m": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": '
          b'"hi", "name": "bob"}], "s": {"max_tokens": 16, "temperature": 0.0, "top_p": 1.0, '
          b'"top_k": 0}}',
    b"x": b'{"resume": [5, 6], "a": 1, "f": 0, "q": 1796169345225, "pre": 0, "row": {"index": '
          b'1, "id": null, "text": "ok", "token_ids": [5, 6], "finish_reason": "stop", "error": '
          b'null, "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0, "attempts": 1, '
          b'"preemptions": 0, "worker": "w1", "queued_at": 1700000000000, "finished_at": '
          b'1700000001000, "metadata": null, "structured": null, "logprobs": null, "choices": '
          b'null, "embedding": null, "cached": false, "cache_source": null}}',
}  # fmt: skip
ROW = Row(index=1, text="ok", token_ids=[5, 6], finish_reason=FinishReason.STOP, prompt_tokens=3,
          completion_tokens=2, attempts=1, worker="w1", queued_at=1700000000000,
          finished_at=1700000001000)  # fmt: skip


def test_entries_the_release_before_wrote_still_read() -> None:
    fresh = Delivery.parse(
        b"1796169345226-1", {b"j": b"j", b"i": b"2", b"r": LINES_AND_BYTES[0][1],
                             b"q": b"1796169345225"}
    )  # fmt: skip
    assert fresh == Delivery(
        entry_id="1796169345226-1", job_id="j", index=2, request=QueuedRequest.decode(
            LINES_AND_BYTES[0][1]), queued_at=1796169345225,
    )  # fmt: skip
    back = Delivery.parse(b"1796169345226-0", OLD_HANDED_BACK, deliveries=2)
    assert back == Delivery(
        entry_id="1796169345226-0", job_id="j", index=0, request=fresh.request, resume=[11, 12],
        prior_runs=1, prior_failures=1, queued_at=1796169345224, preemptions=1,
        last_error="RuntimeError: boom", deliveries=2,
    )  # fmt: skip
    assert (back.attempts, back.failed_attempts) == (3, 3)
    carried = Delivery.parse(b"1796169345226-1", OLD_WITH_ROW)
    assert carried.request == QueuedRequest.decode(OLD_WITH_ROW[b"r"])
    assert carried.request.sampling == {**S16, "max_tokens": 16}  # as written then
    assert (carried.resume, carried.prior_runs, carried.prior_failures) == ([5, 6], 1, 0)
    assert carried.finished == ROW


def test_an_entry_of_an_unknown_format_or_without_its_fields_is_refused() -> None:
    fields = {b"j": b"j", b"i": b"0", b"r": b"{}", b"q": b"7"}
    with pytest.raises(EntryError, match="format 2; this release reads format 1"):
        QueueEntry.decode({**fields, b"v": b"2"}, "1-0")
    assert QueueEntry.decode({**fields, b"v": b"1"}, "1-0").job_id == "j"
    with pytest.raises(EntryError, match="1-0 cannot be read"):
        QueueEntry.decode({b"j": b"j", b"r": b"{}", b"q": b"7"}, "1-0")
    # when it was queued is part of every entry: its stream id does not stand in for it
    unqueued = {b"j": b"j", b"i": b"0", b"r": b"{}"}
    with pytest.raises(EntryError) as refused:
        QueueEntry.decode(unqueued, "1-0")
    assert str(refused.value) == (
        "stream entry 1-0 cannot be read: it has no 'q' field (when it was queued)"
    )
    with pytest.raises(EntryError) as refused:
        QueueEntry.decode({**unqueued, b"x": b'{"resume": [1], "a": 1, "f": 0}'}, "1-0")
    assert str(refused.value) == (
        "stream entry 1-0 cannot be read: its 'x' field has no 'q' (when it was first queued)"
    )
    with pytest.raises(EntryError, match="1-0 cannot be read"):
        QueueEntry.decode({**fields, b"r": b"[1]"}, "1-0")


_TEXT = st.text(st.characters(codec="utf-8"), max_size=12)  # no lone surrogates
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                            "content": _TEXT}, optional={"name": _TEXT}),
                     min_size=1, max_size=3)  # fmt: skip
REQUESTS = st.builds(
    QueuedRequest,
    id=st.none() | _TEXT,
    prompt=st.none() | _TEXT,
    messages=st.none() | _MESSAGES,
    embed=st.none() | _TEXT | st.lists(st.integers(0, 1 << 31), max_size=4),
    dimensions=st.none() | st.integers(1, 1 << 16),
    sampling=st.none() | st.dictionaries(_TEXT, _JSON, max_size=4),
    metadata=st.none() | st.dictionaries(_TEXT, _JSON, max_size=4),
)
ROWS = st.builds(
    Row, index=st.integers(0, 1 << 40), id=st.none() | _TEXT, text=_TEXT,
    token_ids=st.lists(st.integers(0, 1 << 31), max_size=4),
    finish_reason=st.sampled_from(FinishReason), error=st.none() | _TEXT,
    embedding=st.none() | st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=3),
)  # fmt: skip
ENTRIES = st.builds(
    QueueEntry,
    job_id=_TEXT.filter(bool),
    index=st.integers(0, 1 << 40),
    request=REQUESTS,
    resume=st.lists(st.integers(0, 1 << 31), max_size=5),
    prior_runs=st.integers(0, 100),
    prior_failures=st.integers(0, 100),
    queued_at=st.integers(1, 1 << 50),
    preemptions=st.integers(0, 100),
    last_error=_TEXT,
    finished=st.none() | ROWS,
)


def _as_redis(flat: list[str]) -> dict[bytes, bytes]:
    """Fields as XADD stores them and XRANGE gives them back."""
    return {k.encode(): v.encode() for k, v in zip(flat[::2], flat[1::2])}


@settings(max_examples=200, deadline=None)
@given(ENTRIES)
def test_every_field_round_trips(entry: QueueEntry) -> None:
    assert QueuedRequest.decode(entry.request.encode()) == entry.request
    assert QueueEntry.decode(_as_redis(entry.handed_back_fields()), "5-0") == entry
    dispatched = {**_as_redis(entry.request_fields()), b"q": b"5"}  # as dispatch.py writes it
    plain = QueueEntry.decode(dispatched, "9-0")
    assert plain == QueueEntry(entry.job_id, entry.index, entry.request, queued_at=5)


def rconn(url: str) -> Any:
    return redis.Redis.from_url(url)


def test_hand_back_and_dead_letter_write_the_entry_through_lua(redis_url: str) -> None:
    """Through the scripts' JSON (cjson) and XADD: text beyond the BMP, a carried row."""
    conn = rconn(redis_url)
    conn.delete(QK.stream)
    ensure_group(conn, QK)
    job = QK.job("j")
    conn.hset(job.job, mapping={"state": "running", "done": 0, "failed": 0, "total": 3})
    request = QueuedRequest(id="α", prompt="emoji 😀 and \x00 nul", sampling={"n": 1, "stop": ["😀"]},
                      metadata={"k": ["ü", 1.5]})  # fmt: skip
    conn.xadd(QK.stream, {"j": "j", "i": 0, "r": request.encode(), "q": 1})
    conn.xadd(QK.stream, {"j": "j", "i": 1, "r": request.encode(), "q": 1})
    first, second = read_new(conn, QK, "w1", 2, None)
    assert hand_back(conn, QK, "w1", [HandBack(first, [7, 8], 2, failed=True, error="boom 😀",
                                               row=ROW)]) == 1  # fmt: skip
    (back,) = read_new(conn, QK, "w1", 2, None)
    assert back == Delivery(
        entry_id=back.entry_id, job_id="j", index=0, request=request, resume=[7, 8],
        prior_runs=1, prior_failures=1, queued_at=first.queued_at, preemptions=2,
        last_error="boom 😀", finished=ROW,
    )  # fmt: skip
    dead_letter(conn, QK, second, "poison", "w1", json.dumps(ROW.to_dict()))
    ((_, fields),) = conn.xrange(job.dead)
    assert (fields[b"j"], fields[b"i"], QueuedRequest.decode(fields[b"r"])) == (b"j", b"1", request)
    assert (fields[b"reason"], fields[b"deliveries"], fields[b"worker"]) == (b"poison", b"1", b"w1")
