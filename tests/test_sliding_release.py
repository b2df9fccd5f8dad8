"""Sliding windows for real: the full context, and KV blocks that left every layer's
window handed back to the pool (``kv_window.py``) while the tokens stay exact."""

from __future__ import annotations

from batchgen import Engine, SamplingParams
from batchgen.worker.engine.kv_window import SlidingRelease
from tests.family_parity import random_prompts
from tests.hf_reference import hf_greedy
from tests.model_zoo import VOCAB


def test_releasable_blocks_are_those_before_the_next_querys_window():
    policy = SlidingRelease(window=16, block_size=4, keep_last_hashed=False)
    # the next token sits at 20 and sees keys 5..20: blocks 0 (0-3) and 1 (4-7)? no, 4 is out, 5 in
    assert policy.releasable(num_computed=20, num_hashed=5) == 1
    assert policy.releasable(num_computed=23, num_hashed=5) == 2  # sees 8..23
    assert policy.releasable(num_computed=15, num_hashed=3) == 0
    kept = SlidingRelease(window=16, block_size=4, keep_last_hashed=True)
    assert kept.releasable(num_computed=40, num_hashed=3) == 2  # block 2 seeds the next hash
    assert kept.peak_blocks(1000, max_step_tokens=8) == 6 + 2
    assert kept.peak_blocks(10, max_step_tokens=8) == 3


def _record_peak(engine: Engine) -> list[int]:
    """The pool's used blocks after every step's scheduling."""
    used: list[int] = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        used.append(engine.block_manager.num_used_blocks)
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return used


def test_a_generation_many_windows_long_runs_in_a_pool_of_a_few_blocks(zoo_model):
    """Mistral-shaped, window 16 on every layer: 20 prompt + 300 generated tokens in a pool
    of 6 blocks of 16 (96 tokens), exactly as transformers generates them."""
    path = zoo_model("mistral")
    engine = Engine.from_pretrained(path, num_kv_blocks=6, max_num_batched_tokens=24)
    assert engine.max_model_len == 512  # the model's max_position_embeddings, not its window
    used = _record_peak(engine)
    prompts = random_prompts(VOCAB, (20, 3), seed=21)
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(path, prompt, 300, stop_at_eos=False)
        assert out.num_preemptions == 0
    assert max(used) <= 6  # without handing blocks back: 20 + 300 tokens = 20 blocks each
    assert engine.block_manager.num_free_blocks == 6
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_mixed_local_and_global_layers_hand_nothing_back(zoo_model):
    """Qwen2 with max_window_layers 1: layer 0 reads every key, so every block stays."""
    engine = Engine.from_pretrained(zoo_model("qwen2"), num_kv_blocks=64)
    assert engine.scheduler.sliding_release is None
    used = _record_peak(engine)
    engine.generate(random_prompts(VOCAB, (40,), seed=22), SamplingParams(max_tokens=60))
    assert max(used) == 7  # 40 + 60 tokens, blocks of 16
