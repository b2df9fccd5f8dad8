"""The load-time warm-up launches the Triton prefill kernel with every tile choice the
engine's limits allow, so no step (and no timed run) compiles one; it stores nothing."""

from __future__ import annotations

import json

import pytest

from batchgen import Engine
from batchgen.kernels.triton.prefill_attention import prefill_tiles
from batchgen.worker.engine.runner.warmup import prefill_warmup_lengths, warm_up_prefill


def _every_choice(max_query_len: int, group: int, head_dim: int) -> set[tuple[int, int]]:
    return {prefill_tiles(q, group, head_dim) for q in range(1, max_query_len + 1)}


@pytest.mark.parametrize(
    "max_query_len,group,head_dim",
    [(2048, 1, 64), (4096, 4, 128), (8192, 8, 256), (3, 1, 128), (4096, 128, 96)],
)
def test_the_warm_up_lengths_pick_every_tile_choice(max_query_len, group, head_dim):
    lengths = prefill_warmup_lengths(max_query_len, group, head_dim)
    assert {prefill_tiles(q, group, head_dim) for q in lengths.values()} == set(lengths)
    assert set(lengths) == _every_choice(max_query_len, group, head_dim)
    assert max(lengths.values()) <= max_query_len


def test_the_warm_up_runs_each_choice_of_the_engines_limits_and_stores_nothing(
    toy_model, monkeypatch
):
    # before: the benchmark's warm-up ran 4 prompts, one tile choice; the timed run
    # compiled the rest. The CPU path runs the same forwards as on a GPU.
    path = toy_model("llama")
    engine = Engine.from_pretrained(path, num_kv_blocks=16)
    runner, limits = engine.runner, engine.limits
    attention = runner.model.config
    config = json.loads((path / "config.json").read_text())
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    for k, v in runner.kv_caches:
        k.fill_(1.5)
        v.fill_(1.5)
    seen = []
    forward = runner.model.forward

    def recording(input_ids, positions, batch, kv_caches):
        seen.append(batch.prefill_max_query_len)
        return forward(input_ids, positions, batch, kv_caches)

    monkeypatch.setattr(runner.model, "forward", recording)
    max_query_len = min(limits.max_num_batched_tokens, limits.max_model_len)
    ran = warm_up_prefill(runner.model, runner.kv_caches, limits.block_size, max_query_len,
                          group, attention.head_dim)  # fmt: skip
    assert seen == ran
    assert {prefill_tiles(q, group, attention.head_dim) for q in seen} == _every_choice(
        max_query_len, group, attention.head_dim
    )
    assert all(bool((k == 1.5).all()) and bool((v == 1.5).all()) for k, v in runner.kv_caches)
