"""OpenAI batch lines as clients write them: n, logprobs, logit_bias, no-op fields, refusals.

Validation is exact (each field accepted or refused with its line and column),
the engine's logprobs equal HF transformers' log_softmax, a +100 bias decides
greedy, seeded samples are the same wherever they run, and the rows carry
``logprobs`` and ``choices`` end to end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.jobs.intake.inputs import parse_line
from batchgen.jobs.intake.lines import LineError
from batchgen.jobs.schema.errors import ParamError
from batchgen.jobs.schema.rows import CHOICES, LOGPROBS
from batchgen.jobs.schema.sampling import DEFAULTS
from tests.hf_reference import hf_logits
from tests.test_pipeline_e2e import download, submit, write_jsonl
from tests.test_pipeline_e2e import env as env  # fixtures
from tests.test_pipeline_e2e import workers as workers

MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(**body: Any) -> dict[str, Any]:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "gpt-4o-mini", "messages": MESSAGES, **body}}  # fmt: skip


def _completion(**body: Any) -> dict[str, Any]:
    return {"custom_id": "c2", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hi", **body}}  # fmt: skip


def _params(line: dict[str, Any]) -> dict[str, Any]:
    out = parse_line(1, json.dumps(line).encode(), DEFAULTS)
    assert not isinstance(out, LineError), str(out)
    return json.loads(out)["s"]


def _error(line: dict[str, Any]) -> str:
    out = parse_line(1, json.dumps(line).encode(), DEFAULTS)
    assert isinstance(out, LineError), out
    return str(out)


# -- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (_chat(n=3), {"n": 3}),
        (_chat(n=2, best_of=2), {"n": 2}),
        (_chat(logprobs=True), {"logprobs": 0}),
        (_chat(logprobs=True, top_logprobs=2), {"logprobs": 2}),
        (_chat(logprobs=False), {}),
        (_completion(logprobs=5), {"logprobs": 5}),
        (_completion(logprobs=None), {}),
        ({"prompt": "x", "logprobs": 20, "n": 16}, {"logprobs": 20, "n": 16}),
        (_chat(logit_bias={"50": -100, "7": 2.5}), {"logit_bias": {"50": -100.0, "7": 2.5}}),
        ({"prompt": "x", "logit_bias": {"3": 100}}, {"logit_bias": {"3": 100.0}}),
        # accepted and ignored, values checked
        (_chat(store=False, service_tier="auto", user="u-1", metadata={"a": "b"},
               stream=False, parallel_tool_calls=False), {}),
        (_completion(echo=False, suffix=None, best_of=1), {}),
    ],
)  # fmt: skip
def test_fields_clients_send_are_accepted(line, expected):
    params = _params(line)
    for name, value in expected.items():
        assert params[name] == value
    for name in ("n", "logprobs", "logit_bias"):
        if name not in expected:
            assert name not in params


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (_chat(tools=[{"type": "function"}]), "tools[0].function must be an object with a name"),
        (_chat(tool_choice="auto"), 'tool_choice "auto" needs tools'),
        (_chat(functions=[]), "body.functions is not supported by batchgen"),
        (_chat(function_call="none"), "body.function_call is not supported by batchgen"),
        (_chat(audio={"voice": "x"}), "body.audio is not supported by batchgen"),
        (_chat(modalities=["text"]), "body.modalities is not supported by batchgen"),
        (_chat(prediction={}), "body.prediction is not supported by batchgen"),
        (_chat(web_search_options={}), "body.web_search_options is not supported by batchgen"),
        (_chat(stream=True), "body.stream = true is not supported by batchgen (only false)"),
        (_completion(echo=True), "body.echo = true is not supported by batchgen (only false)"),
        (_completion(suffix="x"), 'body.suffix = "x" is not supported by batchgen (only null)'),
        (_chat(store="no"), 'body.store must be true or false, got "no"'),
        (_chat(service_tier=1), "body.service_tier must be a string, got 1"),
        (_chat(n=17), "n must be an integer from 1 to 16, got 17"),
        (_chat(n=0), "n must be an integer from 1 to 16, got 0"),
        (_chat(n=2, best_of=3), "best_of must equal n (batchgen returns every sample), got 3"),
        (_chat(logprobs=1), "body.logprobs must be true or false, got 1"),
        (_chat(top_logprobs=2), "top_logprobs needs logprobs: true"),
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs must be an integer from 0 to 20"),
        (_completion(logprobs=21), "logprobs must be an integer from 0 to 20, got 21"),
        (_chat(logit_bias={"5": 101}), "logit_bias values must be numbers from -100 to 100"),
        (_chat(logit_bias={"x": 1}), 'logit_bias keys must be token ids (integers >= 0), got "x"'),
        (_chat(logit_bias={str(i): 1 for i in range(301)}), "logit_bias has 301 entries"),
        (_chat(logit_bias=[1]), "logit_bias must be an object of token id -> bias"),
        (_chat(temprature=1), "unknown field 'body.temprature' (did you mean 'temperature'?)"),
    ],
)  # fmt: skip
def test_refusals_name_the_field(line, message):
    assert message in _error(line)


def test_a_refusal_points_at_the_field():
    line = json.dumps(_chat(functions=[]))
    out = parse_line(4, line.encode(), DEFAULTS)
    assert isinstance(out, LineError)
    assert out.line == 4 and line[out.column - 1 :].startswith('"functions"')


# -- engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(toy_model) -> Path:
    return toy_model("llama")


@pytest.fixture(scope="module")
def engine(model) -> Engine:
    return Engine.from_pretrained(model, num_kv_blocks=256)


PROMPTS = ["Tell me about the sea.", "One two three four", "The weather today is"]


def test_logprobs_equal_hf_log_softmax_for_the_chosen_and_top_k(engine, model):
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, logprobs=4, ignore_eos=True))
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        reference = torch.log_softmax(hf_logits(model, ids), dim=-1)
        assert out.logprobs is not None
        for k, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = reference[len(out.prompt_token_ids) - 1 + k]
            values, top = row.topk(4)
            best = sorted(entry.items(), key=lambda item: -item[1])[:4]
            assert [t for t, _ in best] == top.tolist()
            assert [lp for _, lp in best] == pytest.approx(values.tolist(), abs=2e-4)
            assert entry[token] == pytest.approx(float(row[token]), abs=2e-4)


def test_a_plus_100_bias_makes_greedy_take_that_token(engine):
    free = engine.generate(PROMPTS[:1], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    target = next(t for t in range(300, 400) if t not in free.token_ids)
    biased = engine.generate(
        PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={target: 100})
    )
    assert [o.token_ids for o in biased] == [[target] * 5] * len(PROMPTS)
    # -100 on the token greedy took removes it
    first = free.token_ids[0]
    banned = engine.generate(
        PROMPTS[:1], SamplingParams(max_tokens=5, ignore_eos=True, logit_bias={first: -100})
    )[0]
    assert first not in banned.token_ids


def test_logit_bias_outside_the_vocabulary_is_rejected(engine):
    with pytest.raises(Exception, match="logit_bias token id 9000 is outside the vocabulary"):
        engine.add_request("big", "hi", SamplingParams(logit_bias={9000: 1.0}))
    with pytest.raises(ParamError):
        SamplingParams(logit_bias={1: 200})


def test_seeded_samples_are_the_same_wherever_they_run(model, engine):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=21, n=3, ignore_eos=True)
    alone = engine.generate(PROMPTS[:1], params)[0]
    samples = [s.token_ids for s in alone.samples]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3  # they differ
    # sample 0 is the n = 1 draw of the same seed
    single = SamplingParams(max_tokens=12, temperature=1.0, seed=21, ignore_eos=True)
    assert engine.generate(PROMPTS[:1], single)[0].token_ids == samples[0]
    # beside other requests, and on a tight engine that preempts
    tight = Engine.from_pretrained(model, num_kv_blocks=6, block_size=16, max_num_seqs=8)
    for eng in (engine, tight):
        mixed = eng.generate(PROMPTS * 2, [params] + [SamplingParams(max_tokens=20)] * 5)
        assert [s.token_ids for s in mixed[0].samples] == samples
    assert tight.stats().num_preemptions > 0


# -- end to end ------------------------------------------------------------------------


def test_a_mixed_file_through_a_worker_gives_logprobs_and_choices(
    model, engine, workers, env, tmp_path
):
    lines = [
        _chat(n=2, temperature=1.0, seed=5, logprobs=True, top_logprobs=2, max_tokens=6,
              store=False, service_tier="auto"),
        _completion(logprobs=3, max_tokens=5),
        {"id": "native", "prompt": "One two three four", "max_tokens": 4,
         "logit_bias": {"333": 100}},
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "m", "input": "The weather today is", "encoding_format": "float"}},
        {"id": "embed-native", "task": "embed", "input": [5, 6, 7, 8], "dimensions": 16},
        {"id": "embed-too-wide", "task": "embed", "input": "hi", "dimensions": 5000},
    ]  # fmt: skip
    lines[0]["custom_id"], lines[1]["custom_id"] = "chat", "completion"
    submit(env, model, write_jsonl(tmp_path / "p.jsonl", lines), "dialect", tmp_path)
    proc = workers(model, "--burst", "--max-num-seqs", "4")
    assert proc.wait(timeout=300) == 0, (tmp_path / "worker-0.log").read_text()[-3000:]
    rows = download(env, "dialect", tmp_path)
    assert rows["id"] == ["chat", "completion", "native", "embed", "embed-native", "embed-too-wide"]

    # embeddings: the engine's vectors, one row per line, null on generation rows
    vectors = [
        engine.embed(["The weather today is"])[0],
        engine.embed([[5, 6, 7, 8]], dimensions=16)[0],
    ]
    assert rows["embedding"][:3] == [None, None, None]
    for got, want in zip(rows["embedding"][3:5], vectors):
        assert got == pytest.approx(want, abs=1e-6)
    assert len(rows["embedding"][4]) == 16
    assert rows["finish_reason"][3:] == ["stop", "stop", "error"]
    assert rows["prompt_tokens"][4] == 4
    assert "dimensions must be an integer in [1, " in rows["error"][5]

    chat = engine.generate(
        [MESSAGES], SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=2)
    )[0]
    choices = rows["choices"][0]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["token_ids"] for c in choices] == [s.token_ids for s in chat.samples]
    assert [c["text"] for c in choices] == [s.text for s in chat.samples]
    assert rows["token_ids"][0] == chat.samples[0].token_ids
    assert rows["completion_tokens"][0] == sum(len(s.token_ids) for s in chat.samples)
    for sample, choice in zip(chat.samples, choices):
        assert sample.logprobs is not None
        for token, entry, got in zip(sample.token_ids, sample.logprobs, choice["logprobs"]):
            assert got["token_id"] == token
            assert got["token"] == engine.token_text(token)
            assert got["logprob"] == pytest.approx(entry[token], abs=1e-5)
            assert len(got["top"]) == 2
            assert [t["token_id"] for t in got["top"]] == sorted(entry, key=lambda t: -entry[t])[:2]
    assert rows["logprobs"][0] == choices[0]["logprobs"]

    completion = engine.generate(["hi"], SamplingParams(max_tokens=5, logprobs=3))[0]
    assert [e["token_id"] for e in rows["logprobs"][1]] == completion.token_ids
    assert all(len(e["top"]) == 3 for e in rows["logprobs"][1])
    assert rows["choices"][1] is None and rows["choices"][2] is None
    assert rows["logprobs"][2] is None
    assert rows["token_ids"][2] == [333] * 4

    table = pq.read_table(tmp_path / "dialect.parquet")
    assert table.schema.field("choices").type.value_type == CHOICES.value_type
    assert table.schema.field("logprobs").type.value_type == LOGPROBS.value_type


def test_n_samples_restart_rather_than_resume_from_one_token_list(engine):
    from batchgen import RequestRejected
    from batchgen.jobs.schema.entry import QueuedRequest
    from batchgen.worker.consumer.queue import Delivery
    from batchgen.worker.loop.flight import resumable

    with pytest.raises(RequestRejected, match="only a request with n = 1 resumes from tokens"):
        engine.add_request("n2", "hi", SamplingParams(n=2), resume_token_ids=[5, 6])

    def delivery(n: int) -> Delivery:
        request = QueuedRequest(prompt="hi", sampling={"n": n})
        return Delivery(entry_id="1-0", job_id="j", index=0, request=request)

    assert resumable(delivery(1), [5, 6]) == [5, 6]
    assert resumable(delivery(2), [5, 6]) == []


def _embedding(**body: Any) -> dict[str, Any]:
    return {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "m", **body}}  # fmt: skip


def _entry(line: dict[str, Any]) -> dict[str, Any]:
    out = parse_line(1, json.dumps(line).encode(), DEFAULTS)
    assert not isinstance(out, LineError), str(out)
    return json.loads(out)


@pytest.mark.parametrize(
    ("line", "entry"),
    [
        (_embedding(input="hello"), {"id": "e1", "e": "hello"}),
        (_embedding(input=["hello"], dimensions=8, encoding_format="float", user="u"),
         {"id": "e1", "e": "hello", "dim": 8}),
        (_embedding(input=[1, 2, 3]), {"id": "e1", "e": [1, 2, 3]}),
        (_embedding(input=[[1, 2, 3]]), {"id": "e1", "e": [1, 2, 3]}),
        ({"task": "embed", "input": "hi", "id": 7, "metadata": {"k": 1}},
         {"e": "hi", "id": "7", "md": {"k": 1}}),
    ],
)  # fmt: skip
def test_embedding_lines_become_embedding_entries(line, entry):
    assert _entry(line) == entry


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (_embedding(input=["a", "b"]), "input holds 2 inputs; batchgen takes one per line"),
        (_embedding(input=""), "input is empty"),
        (_embedding(input=[1, -2]), "input must be a string or a list of token ids"),
        (_embedding(input=5), "input must be a string or a list of token ids, got 5"),
        (_embedding(), "/v1/embeddings needs body.input"),
        (_embedding(input="x", encoding_format="base64"),
         'body.encoding_format = "base64" is not supported by batchgen (only "float")'),
        (_embedding(input="x", dimensions=0), "dimensions must be an integer from 1 to 65536"),
        (_embedding(input="x", max_tokens=3), "unknown field 'body.max_tokens'"),
        ({"input": "hi"}, 'an "input" line needs "task": "embed"'),
        ({"task": "embed"}, '"task": "embed" needs "input"'),
        ({"task": "generate", "input": "x"}, 'an "input" line needs "task": "embed"'),
        ({"task": "embed", "input": "x", "temperature": 1}, "unknown field 'temperature'"),
    ],
)  # fmt: skip
def test_bad_embedding_lines_are_refused(line, message):
    assert message in _error(line)


def test_logit_bias_ids_are_checked_at_submit_when_the_model_is_at_hand(model, redis_url, tmp_path):
    import redis

    from batchgen.jobs.ops.submission import submit as submit_job
    from batchgen.jobs.redis.keys import Keys
    from batchgen.jobs.schema.errors import InvalidInput

    lines = [{"prompt": "a", "logit_bias": {"8191": 1}}, _chat(logit_bias={"5": 1, "8192": -3})]
    path = write_jsonl(tmp_path / "p.jsonl", lines)
    conn: Any = redis.Redis.from_url(redis_url)
    before = conn.dbsize()
    with pytest.raises(InvalidInput) as info:
        submit_job(conn, Keys("bg-vocab"), source_path=str(path), model=str(model),
                   defaults=dict(DEFAULTS), job_id="vocab", output=str(tmp_path / "out"))  # fmt: skip
    column = json.dumps(lines[1]).index('"logit_bias": ') + len('"logit_bias": ') + 1
    assert str(info.value).endswith(
        f"  line 2, column {column}: logit_bias token id 8192 is outside the model's "
        "vocabulary [0, 8192)"
    )
    assert conn.dbsize() == before
    # a model named, not a local checkpoint: the worker decides (an error row)
    assert not isinstance(parse_line(2, json.dumps(lines[1]).encode(), DEFAULTS), LineError)
