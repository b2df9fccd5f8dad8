"""A rank's place in a tensor-parallel group: its collectives (``Shard``), the query and KV
heads it computes (``split_heads``), and what the split refuses before any weight loads
(``check_shardable``). worker/models/tensor_parallel.py cuts the weights by them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed does not export it

from batchgen.worker.models.model_config import ModelConfig, QKNormScope
from batchgen.worker.models.quant.sharding import SPLIT_METHODS
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
