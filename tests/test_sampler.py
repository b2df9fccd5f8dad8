"""Sampler: exact filtering, penalties, and draws keyed by (seed, position)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from batchgen import SamplingParams
from batchgen.jobs.schema.errors import ParamError
from batchgen.jobs.schema.sampling import FIELDS, check
from batchgen.worker.engine.request import EngineRequest
from batchgen.worker.engine.runner.sampler import Sampler, greedy, seeded_uniform


def _req(params: SamplingParams, prompt=(1, 2), output=()) -> EngineRequest:
    tokens = [*prompt, *output]
    return EngineRequest("r", tokens, len(prompt), params, 0)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]])
    out = Sampler(eos_token_ids=())(logits, [_req(SamplingParams()), _req(SamplingParams())])
    assert out.token_ids == [1, 0]
    assert out.logprobs == [None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_picks_torch_argmax_ids_on_ties_nan_and_inf(dtype):
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [[1.0, nan, 3.0, nan], [2.0, 5.0, 5.0, 1.0], [-inf] * 4, [inf, 1.0, inf, 0.0],
         [0.0, -0.0, 0.0, 0.0], [-1.0, -3.0, -0.5, -0.5]],
        dtype=dtype,
    )  # fmt: skip
    ties = torch.randn(64, 8192).to(dtype)
    ties[:, ::7] = ties.max()  # every row's highest value in many columns
    for rows in (logits, ties, ties[:, 5:]):  # the last: rows not contiguous
        picked = greedy(rows)
        assert picked.dtype == torch.int64
        assert picked.tolist() == rows.argmax(dim=-1).tolist()
    assert greedy(logits).tolist() == [1, 1, 0, 0, 0, 2]


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


# -- one batched step: the same tokens and logprobs as row by row, one host copy --------
VOCAB = 50


def _mixed_batch() -> tuple[torch.Tensor, list[EngineRequest], torch.Tensor]:
    """Greedy, top-k, top-p, min-p, seeded and unseeded draws, penalties, logit bias,
    min_tokens, a constrained row and logprobs, in one batch."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, VOCAB, generator=gen) * 3
    out = [int(t) for t in torch.randint(0, VOCAB, (6,), generator=gen)]
    params = [
        SamplingParams(),
        SamplingParams(logprobs=3),
        SamplingParams(temperature=0.7, top_p=0.8, seed=3, logprobs=0),
        SamplingParams(temperature=1.0, min_p=0.1),  # unseeded: the sampler's generator
        SamplingParams(
            repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, logprobs=2
        ),
        SamplingParams(temperature=0.9, top_k=5, seed=9, presence_penalty=0.5, logprobs=3),
        SamplingParams(logit_bias={7: 5.0, 3: -2.5}, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=1.2, top_p=0.95, min_p=0.05, frequency_penalty=0.1, seed=11),
    ]
    requests = [_req(p, prompt=(5, 6, i), output=out[: i % 4]) for i, p in enumerate(params)]
    masks = torch.zeros(8, VOCAB, dtype=torch.bool)
    masks[3, ::3] = True  # a constrained row: every third token not allowed
    return logits, requests, masks


def _row_by_row(logits, requests, masks, eos, generator):
    """The step written plainly, one row at a time. A filter (top-k, top-p, min-p)
    runs on every sampled row when any sampled row asks for it."""
    drawn = [r.params for r in requests if not r.params.greedy]
    top_k_on = any(p.top_k for p in drawn)
    top_p_on = any(np.float32(p.top_p) < 1 for p in drawn)
    min_p_on = any(np.float32(p.min_p) > 0 for p in drawn)
    tokens, logprobs = [], []
    for i, r in enumerate(requests):
        p, row = r.params, logits[i].clone()
        row[masks[i]] = float("-inf")
        if p.has_penalties:
            counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.long),
                                    minlength=VOCAB).float()  # fmt: skip
            seen = torch.tensor(r.token_ids)
            row[seen] = torch.where(row[seen] > 0, row[seen] / p.repetition_penalty,
                                    row[seen] * p.repetition_penalty)  # fmt: skip
            row -= p.frequency_penalty * counts
            row -= p.presence_penalty * (counts > 0).float()
        for t, b in p.bias_pairs:
            row[t] += b
        if r.num_output_tokens < p.min_tokens:
            row[list(p.stop_token_ids) + list(eos)] = float("-inf")
        if p.greedy:
            token = int(row.argmax())
        else:
            x = row / p.temperature
            if top_k_on:
                k = p.top_k if 0 < p.top_k < VOCAB else VOCAB
                x = x.masked_fill(x < x.sort(descending=True).values[k - 1], float("-inf"))
            probs = torch.softmax(x, dim=-1)
            if top_p_on:
                ordered, order = probs.sort(descending=True)
                drop = torch.zeros_like(probs, dtype=torch.bool)
                drop[order] = ordered.cumsum(0) - ordered >= p.top_p
                probs = probs.masked_fill(drop, 0.0)
            if min_p_on:
                probs = probs.masked_fill(probs < probs.max() * p.min_p, 0.0)
            if p.seed is None:
                u = float(torch.rand((), generator=generator, dtype=torch.float64))
            else:
                u = seeded_uniform(p.seed, r.num_tokens, r.sample_index)
            cdf = probs.double().cumsum(0)
            token = min(int(torch.searchsorted(cdf, u * cdf[-1], right=True)), VOCAB - 1)
        tokens.append(token)
        entry = None
        if p.logprobs is not None:
            logp = torch.log_softmax(logits[i], dim=-1)
            values, ids = logp.topk(p.logprobs) if p.logprobs else (logp[:0], logp[:0])
            entry = dict(zip(ids.tolist(), values.tolist()))
            entry[token] = float(logp[token])
        logprobs.append(entry)
    return tokens, logprobs


def test_a_mixed_batch_gets_exactly_the_row_by_row_tokens_and_logprobs():
    logits, requests, masks = _mixed_batch()
    for seed in range(20):  # draws land in different places of the distributions
        out = Sampler(eos_token_ids=(0,), seed=seed)(logits, requests, masks)
        gen = torch.Generator().manual_seed(seed)
        tokens, logprobs = _row_by_row(logits, requests, masks, (0,), gen)
        assert out.token_ids == tokens
        assert out.logprobs == logprobs  # exact floats, same keys in the same order
        assert [list(e) for e in out.logprobs if e] == [list(e) for e in logprobs if e]
    assert out.token_ids[6] == 7  # the +5 bias; the stop and EOS are held off by min_tokens


class _HostReads:
    """Counts the Tensor methods that move a value to the host (a device sync on a GPU)."""

    NAMES = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in self.NAMES:
            monkeypatch.setattr(
                torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name))
            )

    def _counted(self, name, method):
        def counted(tensor, *args, **kwargs):
            self.calls.append(name)
            return method(tensor, *args, **kwargs)

        return counted


def test_a_sampled_step_reads_the_device_once(monkeypatch):
    # before: (top_ps < 1).any() and (min_ps > 0).any() as Python bools, bincount and a
    # token-list copy per penalised row, .tolist() and float() per logprobs row
    logits, requests, masks = _mixed_batch()
    sampler = Sampler(eos_token_ids=(0,), seed=0)
    reads = _HostReads(monkeypatch)
    # on the CPU the greedy ids are numpy's argmax over a view of the logits (no copy, no
    # device); on a GPU torch's argmax stays there (test_a_sampled_step_syncs_the_gpu_once)
    sampler(logits, requests, masks)
    assert reads.calls == ["numpy", "tolist"]
    reads.calls.clear()
    sampler(logits, [_req(SamplingParams()), _req(SamplingParams())])  # greedy: argmax alone
    assert reads.calls == ["numpy", "tolist"]


@pytest.mark.gpu
def test_a_sampled_step_syncs_the_gpu_once():
    logits, requests, masks = _mixed_batch()
    logits, masks = logits.cuda(), masks.cuda()
    # first use: pinned blocks allocated, kernels loaded
    expected = Sampler(eos_token_ids=(0,), seed=0)(logits, requests, masks)
    sampler = Sampler(eos_token_ids=(0,), seed=0)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = sampler(logits, requests, masks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1  # the copy of the results
    assert out.token_ids == expected.token_ids
