"""CUDA-graph decode: the sizes it captures (CPU) and replay == eager (GPU only)."""

from __future__ import annotations

import random

import pytest

from batchgen.worker import Engine, SamplingParams
from batchgen.worker.engine.cuda_graphs import graph_batch_sizes


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]


def test_cpu_engine_never_captures(toy_model):
    engine = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=16)
    assert engine.runner.graphs is None


@pytest.mark.gpu
def test_graph_replay_equals_eager_on_cuda(toy_model):
    path = toy_model("qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(16, 8192) for _ in range(rng.randint(5, 90))] for _ in range(37)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    def engine(graphs: bool) -> Engine:
        return Engine.from_pretrained(
            path, device="cuda", dtype="float32", num_kv_blocks=1024, max_num_seqs=64,
            use_cuda_graphs=graphs,
        )  # fmt: skip

    graphed, eager = engine(True), engine(False)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    a = [o.token_ids for o in graphed.generate(prompts, params)]
    b = [o.token_ids for o in eager.generate(prompts, params)]
    assert a == b
