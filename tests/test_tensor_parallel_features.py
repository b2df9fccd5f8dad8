"""Tensor parallelism keeps every engine feature: 2 CPU ranks against 1 rank, exactly.

Rank 0 owns scheduling, the block tables and sampling, on logits all-gathered
from the ranks' vocabulary columns; the other ranks only run the model. So
structured output, n > 1 with seeds, logprobs and preemption give one rank's
tokens. Logprob values are sums in another order (each block's all-reduce), so
they are compared within ``LOGPROB_TOLERANCE``: the largest gap measured on
these prompts was 7e-6 nats, float32's rounding.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest

from batchgen import Engine, SamplingParams, StructuredOutput

# 12 blocks of 16 tokens: room for the short requests, too little for PREEMPTED at once
SETTINGS = dict(num_kv_blocks=12, threads=1, max_num_batched_tokens=48, max_num_seqs=8)
LOGPROB_TOLERANCE = 1e-4
PROMPTS = [f"Record {i}: describe item {i * 7 % 13} in JSON." for i in range(4)]
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["label", "score", "note"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engines(toy_model) -> Iterator[tuple[Engine, Engine]]:
    """One rank and two ranks on the same checkpoint and settings."""
    path = toy_model("llama")
    one = Engine.from_pretrained(path, **SETTINGS)
    two = Engine.from_pretrained(path, **SETTINGS, tensor_parallel_size=2)
    try:
        yield one, two
    finally:
        two.close()


def _both(engines, prompts, params):
    one, two = engines
    return one.generate(prompts, params), two.generate(prompts, params)


def test_structured_output_gives_one_ranks_tokens(engines):
    constraint = StructuredOutput(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=40, structured_output=constraint),  # greedy
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, structured_output=constraint),
        SamplingParams(max_tokens=40, temperature=1.0, seed=6, structured_output=constraint),
    ]
    one, two = _both(engines, PROMPTS[:3], params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert [o.finish_reason for o in two] == ["stop"] * 3  # the constraint did the work
    for out in two:
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_n_seeded_samples_are_one_ranks_samples(engines):
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=11, n=3,
                            ignore_eos=True)  # fmt: skip
    one, two = _both(engines, PROMPTS[:2], params)
    for a, b in zip(one, two):
        assert len(b.samples) == 3
        assert [s.token_ids for s in b.samples] == [s.token_ids for s in a.samples]
        assert len({tuple(s.token_ids) for s in b.samples}) > 1  # really three draws


def test_logprobs_and_top_logprobs_match_one_rank(engines):
    params = [
        SamplingParams(max_tokens=6, logprobs=5, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True),  # the sampled token's only
    ]
    one, two = _both(engines, PROMPTS[:3], params)
    widest = 0.0
    for a, b, p in zip(one, two, params):
        assert b.token_ids == a.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        assert len(b.logprobs) == len(b.token_ids)
        for token, ref, got in zip(b.token_ids, a.logprobs, b.logprobs):
            assert list(got) == list(ref)  # the same ids, in the same (ranked) order
            assert token in got and len(got) >= max(p.logprobs or 0, 1)
            widest = max(widest, *(abs(got[t] - ref[t]) for t in ref))
    assert widest <= LOGPROB_TOLERANCE, widest


def test_preemption_recomputes_one_ranks_tokens(engines):
    """Six requests of 30..60 prompt tokens growing by 40 in 12 blocks: rank 0's scheduler
    preempts and recomputes, and the other rank's KV cache follows its block tables."""
    prompts = [[(97 * i + 13 * j) % 8000 + 5 for j in range(30 + 6 * i)] for i in range(6)]
    params = [
        SamplingParams(max_tokens=40, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, seed=21, ignore_eos=True),
    ] * 3
    one_engine, two_engine = engines
    before = (one_engine.stats().num_preemptions, two_engine.stats().num_preemptions)
    one, two = _both(engines, prompts, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    preempted = two_engine.stats().num_preemptions - before[1]
    assert preempted > 0
    assert preempted == one_engine.stats().num_preemptions - before[0]  # the same schedule
    assert sum(o.num_preemptions for o in two) == preempted
