"""A rank's place in a tensor-parallel group: its collectives (``Shard``), the query and KV
heads it computes (``split_heads``), its vocabulary (``vocab_span``), the part of each split
tensor it reads (``RankSlices``), and what the split refuses before any weight loads
(``check_shardable``). worker/models/tensor_parallel.py cuts the weights by them.

``RankSlices`` says which ``Slice`` of a plain (unquantized) projection, embedding or LM
head is this rank's, so worker/models/loader.py reads only those bytes: a column-parallel
projection (q, k, v, gate, up; HF (out, in)) its rows, one byte range per run; a
row-parallel one (o, down) its columns, one range per row; the embedding and LM head
their vocabulary rows; KV heads shared by several ranks (ranks outnumbering them) the one
head each rank reads. The reader (worker/models/dense_weights.py) asks for these; what it
takes without a slice is read whole and cut after (tensor_parallel.py): norms, the biases
of row-parallel projections, per-head q/k norms, sinks, learned positions, every
quantized projection (GPTQ/AWQ packed values, scales, zero points, g_idx, FP8 blocks,
compressed-tensors, online-quantized ones), MoE experts and routers, MLA attention
(DeepSeek), and projections a family reorders at load (GPT-NeoX's head-major q/k/v,
interleaved rotary: Cohere, GLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed does not export it

from batchgen.worker.models.model_config import ModelConfig, QKNormScope
from batchgen.worker.models.quant.sharding import SPLIT_METHODS
from batchgen.worker.models.tensor_store import Slice
from batchgen.worker.worker_errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's place in its group, and the group its collectives run on."""

    rank: int
    world: int
    group: Any = None  # a torch.distributed backend (ProcessGroupGloo or ProcessGroupNCCL)
    timeout: timedelta = timedelta(minutes=5)  # one collective's longest wait

    def _options(self, kind: Any) -> Any:
        options = kind()
        options.timeout = self.timeout
        return options

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [start, end) of n things split as evenly as they go."""
        return n * self.rank // self.world, n * (self.rank + 1) // self.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.allreduce([x], self._options(dist.AllreduceOptions)).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.group.allgather([parts], [x], self._options(AllgatherOptions)).wait()
        return parts


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Which query heads and KV heads a rank computes."""

    q: tuple[int, int]
    kv: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv[1] - self.kv[0]


def split_heads(num_heads: int, num_kv_heads: int, shard: Shard, name: str) -> HeadSplit:
    """Query heads split evenly; KV heads too, or, when the ranks outnumber them, the one
    KV head this rank's query heads read (replicated on the ranks that share it)."""
    world, rank = shard.world, shard.rank
    if num_heads % world:
        raise UnsupportedModelError(
            f"tensor_parallel_size {world} must divide {name}'s {num_heads} attention heads"
        )
    per_rank = num_heads // world
    q = (rank * per_rank, (rank + 1) * per_rank)
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise UnsupportedModelError(
                f"tensor_parallel_size {world} must divide {name}'s {num_kv_heads} KV heads "
                "(or be a multiple of them)"
            )
        kv_per_rank = num_kv_heads // world
        return HeadSplit(q, (rank * kv_per_rank, (rank + 1) * kv_per_rank))
    if world % num_kv_heads:
        raise UnsupportedModelError(
            f"tensor_parallel_size {world} must be a multiple of {name}'s {num_kv_heads} KV "
            "heads (or divide them)"
        )
    head = rank * num_kv_heads // world
    return HeadSplit(q, (head, head + 1))


def vocab_span(vocab_size: int, shard: Shard) -> tuple[tuple[int, int], int]:
    """This rank's [start, end) of the vocabulary, and the widest rank's size."""
    per_rank = -(-vocab_size // shard.world)
    start = min(shard.rank * per_rank, vocab_size)
    return (start, min(start + per_rank, vocab_size)), per_rank


class Split(Enum):
    """How a reader's tensor is split over the ranks (the HF (out, in) weight's runs)."""

    Q = "q"  # rows: this rank's query heads
    KV = "kv"  # rows: its KV heads (k and v each)
    QKV = "qkv"  # rows of one fused q | k | v projection: its heads of each
    INTER = "inter"  # rows: its span of the MLP's intermediate width (gate, up, fc1)
    GATE_UP = "gate_up"  # rows of one fused gate | up projection: its span of each
    OUT = "o"  # columns: its query heads' outputs
    DOWN = "down"  # columns: its span of the intermediate width
    VOCAB = "vocab"  # rows of the embedding or LM head: its vocabulary


@dataclass(frozen=True, slots=True)
class RankSlices:
    """The part of each ``Split`` tensor one rank reads; the same parts
    worker/models/tensor_parallel.py keeps when it cuts a tensor read whole."""

    heads: HeadSplit
    head_dim: int
    num_heads: int
    num_kv_heads: int
    inter: tuple[int, int]  # [start, end) of the intermediate width
    inter_size: int
    vocab: tuple[int, int]

    def of(self, split: Split) -> Slice:
        d, (q0, q1), (k0, k1) = self.head_dim, self.heads.q, self.heads.kv
        q, kv = (q0 * d, q1 * d), (k0 * d, k1 * d)
        s0, s1 = self.inter
        k_at, v_at = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
        runs = {
            Split.Q: (q,),
            Split.KV: (kv,),
            Split.QKV: (q, (k_at + kv[0], k_at + kv[1]), (v_at + kv[0], v_at + kv[1])),
            Split.INTER: (self.inter,),
            Split.GATE_UP: (self.inter, (self.inter_size + s0, self.inter_size + s1)),
            Split.OUT: (q,),
            Split.DOWN: (self.inter,),
            Split.VOCAB: (self.vocab,),
        }[split]
        return Slice(1 if split in (Split.OUT, Split.DOWN) else 0, runs)


def rank_slices(config: ModelConfig, heads: HeadSplit, shard: Shard) -> RankSlices:
    a, inter = config.attention, config.mlp.intermediate_size
    return RankSlices(heads, a.head_dim, a.num_heads, a.num_kv_heads, shard.span(inter), inter,
                      vocab_span(config.vocab_size, shard)[0])  # fmt: skip


def check_shardable(config: ModelConfig, world: int) -> None:
    """Refuse, by name, what this split cannot run on ``world`` ranks (before any weight loads)."""
    a = config.attention
    if a.qk_norm is not None and a.qk_norm.scope is QKNormScope.ALL and world > 1:
        raise UnsupportedModelError(
            f"{config.family}'s q/k norm spans every head's projection; tensor parallelism "
            "does not split it yet (run it with tensor_parallel_size 1)"
        )
    method = None if config.quantization is None else config.quantization.method
    if method is not None and method not in SPLIT_METHODS and world > 1:
        raise UnsupportedModelError(
            f"this {config.family} checkpoint is {method}-quantized; tensor parallelism splits "
            f"{', '.join(SPLIT_METHODS)} weights only (run it with tensor_parallel_size 1)"
        )
    split_heads(a.num_heads, a.num_kv_heads, Shard(0, world), config.family)
