"""Sampler: exact filtering, penalties, and draws keyed by (seed, position)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from batchgen import SamplingParams
from batchgen.jobs.schema.sampling import FIELDS, ParamError, check
from batchgen.worker.engine.request import EngineRequest
from batchgen.worker.engine.sampler import Sampler, seeded_uniform


def _req(params: SamplingParams, prompt=(1, 2), output=()) -> EngineRequest:
    tokens = [*prompt, *output]
    return EngineRequest("r", tokens, len(prompt), params, 0)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    out = Sampler(eos_token_ids=())(logits, [_req(SamplingParams()), _req(SamplingParams())])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


def test_filtered_probabilities_are_exact():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    top_k = Sampler._filtered_probs(logits, [_req(SamplingParams(temperature=1.0, top_k=2))])
    torch.testing.assert_close(top_k, torch.tensor([[0.5, 0.2, 0, 0, 0]]) / 0.7)
    top_p = Sampler._filtered_probs(logits, [_req(SamplingParams(temperature=1.0, top_p=0.8))])
    # 0.5 + 0.2 < 0.8, so the third token is still needed; the rest go
    torch.testing.assert_close(top_p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]))
    min_p = Sampler._filtered_probs(logits, [_req(SamplingParams(temperature=1.0, min_p=0.3))])
    torch.testing.assert_close(min_p, torch.tensor([[0.5, 0.2, 0.15, 0, 0]]))


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    sampler = Sampler(eos_token_ids=(), seed=0)
    counts = torch.zeros(4)
    for i in range(3000):
        token = sampler(logits, [_req(SamplingParams(temperature=1.0), output=[0] * i)]).token_ids[
            0
        ]
        counts[token] += 1
    assert counts[3] == 0  # zero probability is never drawn
    torch.testing.assert_close(counts / 3000, torch.tensor([0.7, 0.2, 0.1, 0.0]), atol=0.03, rtol=0)


def test_seeded_draw_depends_only_on_seed_position_and_sample():
    assert seeded_uniform(7, 10) == seeded_uniform(7, 10)
    draws = {seeded_uniform(7, p) for p in range(100)}
    assert len(draws) == 100 and all(0 <= d < 1 for d in draws)
    assert seeded_uniform(7, 10) != seeded_uniform(8, 10)
    assert seeded_uniform(7, 10, 0) != seeded_uniform(7, 10, 1)
    # the same request at the same position gets the same token whatever its batch mates
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = Sampler(eos_token_ids=())(logits[1:2], [_req(params)]).token_ids[0]
    mates = [_req(SamplingParams(temperature=0.5, seed=1)), _req(params), _req(SamplingParams())]
    batch = Sampler(eos_token_ids=())(logits, mates).token_ids
    assert batch[1] == alone


def test_penalties():
    logits = torch.tensor([[2.0, -1.0, 1.0, 0.5]])
    p = SamplingParams(repetition_penalty=2.0)
    got = logits.clone()
    Sampler(eos_token_ids=())._apply_penalties(got, [_req(p, prompt=(0,), output=(1,))])
    torch.testing.assert_close(got, torch.tensor([[1.0, -2.0, 1.0, 0.5]]))
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = logits.clone()
    Sampler(eos_token_ids=())._apply_penalties(got, [_req(p, prompt=(3,), output=(2, 2, 0))])
    # prompt tokens are not counted by frequency/presence penalties
    torch.testing.assert_close(got, torch.tensor([[2.0 - 0.75, -1.0, 1.0 - 1.25, 0.5]]))


def test_min_tokens_blocks_eos():
    logits = torch.tensor([[9.0, 1.0, 0.0]])
    sampler = Sampler(eos_token_ids=(0,))
    early = sampler(logits, [_req(SamplingParams(min_tokens=2), output=(1,))]).token_ids
    late = sampler(logits, [_req(SamplingParams(min_tokens=2), output=(1, 1))]).token_ids
    assert early == [1] and late == [0]


def test_logprobs_top_k_and_sampled():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    out = Sampler(eos_token_ids=())(logits, [_req(SamplingParams(logprobs=1))])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx({0: torch.log(torch.tensor(0.6)).item()})


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer from 1 to 1048576, got 0"),
        ({"max_tokens": "x"}, 'max_tokens must be an integer from 1 to 1048576, got "x"'),
        ({"temperature": -1}, "temperature must be a number >= 0 and <= 100, got -1"),
        ({"temperature": float("nan")}, "temperature must be a number >= 0 and <= 100, got NaN"),
        ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5"),
        ({"top_k": -1}, "top_k must be an integer from 0 to 1048576 (0 turns it off), got -1"),
        ({"stop": [""]}, "each stop string must have 1 to 1000 characters"),
        ({"n": 0}, "n must be an integer from 1 to 16, got 0"),
        ({"seed": -1}, "seed must be an integer from 0 to 9223372036854775807, got -1"),
    ],
)
def test_bad_params_are_rejected_with_a_message(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message


def test_the_engine_and_the_queue_share_one_sampling_spec():
    # before: the engine took temperature 150 and penalties of 5 that submit refused,
    # and wrote its defaults apart from the queue's
    assert [f.name for f in dataclasses.fields(SamplingParams)] == list(FIELDS)
    defaults = SamplingParams()
    assert {name: getattr(defaults, name) for name in FIELDS} == {
        name: field.default for name, field in FIELDS.items()
    }
    bad: list[tuple[str, Any]] = [
        ("temperature", 150.0), ("presence_penalty", 5.0), ("frequency_penalty", -2.5),
        ("repetition_penalty", 101.0), ("max_tokens", 1 << 21), ("stop", ["x"] * 17),
    ]  # fmt: skip
    for name, value in bad:
        with pytest.raises(ParamError) as line_error:
            check(name, value)
        with pytest.raises(ParamError) as engine_error:
            SamplingParams(**{name: value})
        assert str(engine_error.value) == str(line_error.value)
    # what a line may set is checked the same way in both
    params = SamplingParams(temperature=1, stop="###", stop_token_ids=[7], seed=3)
    assert (params.temperature, params.stop, params.stop_token_ids) == (1.0, ("###",), (7,))
    assert params == SamplingParams(temperature=1.0, stop=("###",), stop_token_ids=(7,), seed=3)
