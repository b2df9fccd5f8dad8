"""A KV pool for two sequences under 64 long requests, through the whole pipeline."""

from __future__ import annotations

import time

from tests.chaos.harness import assert_exactly_once, assert_nothing_left


def test_a_preemption_storm_finishes_every_request_as_an_unconstrained_run(chaos, reference):
    """8 blocks of 16 tokens hold two of these ~60-token sequences; the worker admits
    up to 64 at once, so requests preempt each other all the time. Every request
    finishes (in bounded time: no livelock) with exactly the tokens of a roomy run."""
    lines = [{"id": f"s{i}", "prompt": f"Storm {i}: tell a long story about the sea.",
              "max_tokens": 48, "ignore_eos": True} for i in range(64)]  # fmt: skip
    out = chaos.submit("storm", lines)
    start = time.monotonic()
    worker = chaos.loop_worker("storm", burst=True, max_num_seqs=64, num_kv_blocks=8)
    assert worker.wait(240) == 0, worker.tail()
    wall = time.monotonic() - start
    assert chaos.finalize() == 1
    rows = chaos.result("storm")
    assert_exactly_once(rows, lines, reference(lines))  # the reference: a default-sized pool
    assert rows["completion_tokens"] == [48] * 64
    preemptions = sum(rows["preemptions"])
    assert preemptions >= 16, preemptions  # a storm indeed (42 on the dev machine)
    assert_nothing_left(chaos, "storm", out)
    print(f"preemption storm: 64 requests, {preemptions} preemptions, {wall:.1f}s")
