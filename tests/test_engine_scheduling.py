"""Preemption, prefix caching and seeded sampling give the same tokens as the easy path."""

from __future__ import annotations

import random

import pytest

from batchgen import Engine, SamplingParams
from batchgen.worker.engine.request import EngineRequest
from batchgen.worker.engine.scheduler import pick_victim


def _random_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(8192) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama(toy_model):
    return toy_model("llama")


def test_tiny_kv_pool_preempts_and_gives_identical_outputs(llama):
    prompts = _random_prompts(16, 20, 60, seed=0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = Engine.from_pretrained(llama, num_kv_blocks=512)
    expected = [o.token_ids for o in roomy.generate(prompts, params)]
    # 7 blocks of 16 tokens: at most one or two of these 60..100-token sequences fit
    tight = Engine.from_pretrained(llama, num_kv_blocks=7)
    outputs = tight.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert tight.stats().num_preemptions > 0
    assert sum(o.num_preemptions for o in outputs) == tight.stats().num_preemptions
    # every block came back
    assert tight.block_manager.num_free_blocks == 7
    assert all(b.ref_count == 0 for b in tight.block_manager.blocks)


def test_preemption_storm_leaves_no_request_starved(llama):
    """Pool for two sequences, many long outputs: all finish, the oldest is never a victim."""
    prompts = _random_prompts(12, 10, 20, seed=1)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    engine = Engine.from_pretrained(llama, num_kv_blocks=10, max_num_seqs=8)
    outputs = engine.generate(prompts, params)
    assert all(len(o.token_ids) == 60 for o in outputs)
    assert outputs[0].num_preemptions == 0  # the oldest request always makes progress
    # bounded: a request can be pushed back at most once per request ahead of it
    for i, out in enumerate(outputs):
        assert out.num_preemptions <= i, (i, out.num_preemptions)
    assert engine.stats().num_preemptions > 0


def test_pick_victim_is_least_important_then_latest():
    def req(priority, order):
        return EngineRequest(f"r{order}", [1], 1, SamplingParams(), order, priority=priority)

    a, b, c = req(0, 0), req(0, 5), req(1, 2)
    assert pick_victim([a, b, c]) is c  # lower priority value runs first, so c goes
    assert pick_victim([a, b]) is b


def test_prefix_caching_on_and_off_give_identical_outputs(llama):
    rng = random.Random(2)
    prefix = [rng.randrange(8192) for _ in range(100)]
    prompts = [prefix + [rng.randrange(8192) for _ in range(rng.randint(1, 30))] for _ in range(12)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    on = Engine.from_pretrained(llama, num_kv_blocks=256, enable_prefix_caching=True)
    off = Engine.from_pretrained(llama, num_kv_blocks=256, enable_prefix_caching=False)
    # the first request alone warms the cache; the rest then share its 6 full blocks
    first_on = on.generate(prompts[:1], params)
    first_off = off.generate(prompts[:1], params)
    rest_on = on.generate(prompts[1:], params)
    rest_off = off.generate(prompts[1:], params)
    assert [o.token_ids for o in first_on + rest_on] == [o.token_ids for o in first_off + rest_off]
    assert all(o.num_cached_tokens == 96 for o in rest_on)
    assert all(o.num_cached_tokens == 0 for o in rest_off)
    assert on.stats().prefix_cache_hit_rate > 0.5
    assert off.stats().prefix_cache_hit_rate == 0.0


SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=200, seed=1234)


def test_seeded_request_same_alone_among_others_and_after_preemption(llama):
    target = _random_prompts(1, 30, 30, seed=3)[0]
    alone = Engine.from_pretrained(llama, num_kv_blocks=256).generate([target], SEEDED)[0]
    assert len(set(alone.token_ids)) > 5  # actually sampled, not a constant

    others = _random_prompts(31, 5, 80, seed=4)
    mixed_params = [
        SamplingParams(max_tokens=24, temperature=1.0, seed=i)
        if i % 2
        else SamplingParams(max_tokens=24)
        for i in range(31)
    ]
    crowd = Engine.from_pretrained(llama, num_kv_blocks=256)
    outs = crowd.generate(
        [*others[:13], target, *others[13:]], [*mixed_params[:13], SEEDED, *mixed_params[13:]]
    )
    assert outs[13].token_ids == alone.token_ids

    tight = Engine.from_pretrained(llama, num_kv_blocks=8)
    outs = tight.generate([*others[:5], target], [*mixed_params[:5], SEEDED])
    assert outs[5].num_preemptions > 0 or tight.stats().num_preemptions > 0
    assert outs[5].token_ids == alone.token_ids


def test_different_seeds_and_unseeded_differ(llama):
    engine = Engine.from_pretrained(llama, num_kv_blocks=256)
    prompt = _random_prompts(1, 30, 30, seed=3)[0]
    a = engine.generate([prompt], SEEDED)[0].token_ids
    other = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=200, seed=99)
    b = engine.generate([prompt], other)[0].token_ids
    assert a != b


def test_chunked_prefill_budget_and_max_num_seqs(llama):
    engine = Engine.from_pretrained(
        llama, num_kv_blocks=256, max_num_batched_tokens=32, max_num_seqs=3
    )
    prompts = _random_prompts(5, 50, 50, seed=5)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4, ignore_eos=True))
    plan = engine.scheduler.schedule()
    assert plan.prefill_lens == [32]  # one 50-token prompt, cut to the budget
    assert plan.decodes == []
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes.append(len(engine.scheduler.running))
    assert max(sizes) == 3


def test_requests_sharing_a_prefix_that_arrive_together_compute_it_once(llama):
    rng = random.Random(7)
    prefix = [rng.randrange(16, 8192) for _ in range(64)]  # 4 blocks
    prompts = [prefix + [rng.randrange(16, 8192) for _ in range(5)] for _ in range(4)]
    engine = Engine.from_pretrained(llama, num_kv_blocks=64)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=3, ignore_eos=True))
    first = engine.scheduler.schedule()
    # only the first is admitted; the others would compute the same 64 tokens again
    assert [r.request_id for r in first.prefills] == ["0"]
    engine.runner.run(first)  # (the test drives the steps by hand from here)
    sampled = [0]
    engine.scheduler.update(first, sampled)
    second = engine.scheduler.schedule()
    assert [r.request_id for r in second.prefills] == ["1", "2", "3"]
    assert all(r.num_cached_tokens == 64 for r in second.prefills)
    assert second.prefill_lens == [5, 5, 5]
