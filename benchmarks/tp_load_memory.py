"""The host memory a tensor-parallel rank adds while it builds its shard of a checkpoint.

    python benchmarks/tp_load_memory.py               # the "small" toy llama, fp32
    python benchmarks/tp_load_memory.py --size tiny

Writes the toy llama (``batchgen.toy``), then for 1 rank and each rank of 2 starts a
fresh process that builds that rank's model on the CPU
(``worker/models/tensor_parallel.py``'s ``build_sharded_model``, no group needed) and
prints its peak RSS (``ru_maxrss``) less its RSS before the build, the bytes its
layers' projections hold, and the bytes it read from the checkpoint's files (a rank
reads only its slices of the split tensors: worker/models/tensor_shard.py).
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _rss_mib() -> int:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) // 1024


def _one_rank(path: Path, world: int, rank: int) -> None:
    import torch

    from batchgen.kernels.ops import select_ops
    from batchgen.worker.models.registry import load_model_config
    from batchgen.worker.models.tensor_parallel import build_sharded_model
    from batchgen.worker.models.tensor_shard import Shard

    config = load_model_config(path)
    cpu = torch.device("cpu")
    before = _rss_mib()
    model = build_sharded_model(
        path,
        config,
        cpu,
        torch.float32,
        select_ops(cpu),
        64,
        Shard(rank, world),
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    layers: list[Any] = model.weights.layers  # ReducedAttention / ReducedMlp blocks
    held = sum(
        linear.weight.numel() * linear.weight.element_size()
        for layer in layers
        for linear in (layer.attention.block.qkv, layer.attention.block.o)
        + (layer.mlp.block.up, layer.mlp.block.down)
    )
    reads = model.reads
    print(f"ranks {world}, rank {rank}: peak RSS - RSS before the build {peak - before} MiB; "
          f"layer projections held {held >> 20} MiB; read {reads.bytes} bytes of the "
          f"checkpoint in {reads.calls} reads")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rank-of", nargs=3, help=argparse.SUPPRESS)  # PATH WORLD RANK
    parser.add_argument("--write", help=argparse.SUPPRESS)  # PATH
    args = parser.parse_args()
    if args.rank_of:
        path, world, rank = args.rank_of
        _one_rank(Path(path), int(world), int(rank))
        return
    if args.write:
        from batchgen.toy import write_toy_checkpoint

        write_toy_checkpoint(Path(args.write), arch="llama", size=args.size)
        return
    # each step its own process: a child starts with its parent's peak RSS (Linux keeps
    # the high-water mark across fork and exec), so this one stays small
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "toy"
        subprocess.run([sys.executable, __file__, "--size", args.size, "--write", str(path)],
                       check=True)  # fmt: skip
        for world, rank in ((1, 0), (2, 0), (2, 1)):
            subprocess.run([sys.executable, __file__, "--rank-of", str(path), str(world),
                            str(rank)], check=True)  # fmt: skip


if __name__ == "__main__":
    main()
