"""CUDA-graph decode: the sizes it captures and the runner's dispatch (CPU), replay == eager (GPU)."""

from __future__ import annotations

import random

import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.kernels.batch import AttentionBatch
from batchgen.worker.engine.runner.cuda_graphs import graph_batch_sizes
from batchgen.worker.engine.runner.model_runner import ModelRunner


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]


def test_cpu_engine_never_captures(toy_model):
    engine = Engine.from_pretrained(toy_model("llama"), num_kv_blocks=16)
    assert engine.runner.graphs is None
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert engine.stats().cuda_graph_replays == 0


class RecordingGraphs:
    """Stands in for CudaGraphDecoder on the CPU: records the (rows, decode rows)
    of every batch the runner hands it and runs that batch eagerly."""

    def __init__(self, runner: ModelRunner, max_batch: int) -> None:
        self.forward = runner.model.forward
        self.kv_caches = runner.kv_caches
        self.max_batch = max_batch
        self.calls: list[tuple[int, int]] = []

    def can_run(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.max_batch

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        self.calls.append((input_ids.shape[0], batch.num_decode_tokens))
        return self.forward(input_ids, positions, batch, self.kv_caches)


def test_decode_only_steps_that_fit_a_captured_size_replay_the_graphs(toy_model):
    path = toy_model("llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(16, 8192) for _ in range(n)] for n in (5, 17, 33, 9, 40, 21)]
    # one prefill step, then decode steps of 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1 rows
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (3, 5, 7, 9, 11, 13)]
    expected = Engine.from_pretrained(path, num_kv_blocks=64).generate(prompts, params)

    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    graphs = RecordingGraphs(engine.runner, max_batch=4)
    engine.runner.graphs = graphs
    eager: list[tuple[int, int]] = []
    model = engine.runner.model

    def forward(input_ids, positions, batch, kv_caches):
        eager.append((input_ids.shape[0], batch.num_decode_tokens))
        return graphs.forward(input_ids, positions, batch, kv_caches)

    model.forward = forward  # type: ignore[method-assign]
    outputs = engine.generate(prompts, params)

    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert graphs.calls == [(4, 4), (4, 4), (3, 3), (3, 3), (2, 2), (2, 2), (1, 1), (1, 1)]
    assert eager == [(125, 0), (6, 6), (6, 6), (5, 5), (5, 5)]  # the prefill and batches of 5+
    assert engine.stats().cuda_graph_replays == 8


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
    # without replays both sides ran eager and the comparison proved nothing:
    # every step after the prefills is a decode of at most 64 rows
    stats = graphed.stats()
    assert stats.cuda_graph_replays > 0
    assert stats.cuda_graph_replays >= stats.num_steps - 3  # 37 prompts in <= 3 prefill steps
    assert eager.stats().cuda_graph_replays == 0
