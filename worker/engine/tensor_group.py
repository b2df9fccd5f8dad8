"""A tensor-parallel group: the engine process is rank 0, the other ranks are processes it starts.

Rank 0 owns everything an engine owns (the scheduler, the block tables, the
prefix cache, sampling, structured output); the other ranks hold their shard
of the model and of the KV cache (``worker/models/tensor_parallel.py``) and
nothing else. Each step rank 0 sends them the step's host arrays
(``model_runner.HostStep``: token ids, positions, slot mapping, block
tables) and all of them run the forward together, meeting in its
collectives; only rank 0 samples.

Communication is ``torch.distributed``'s process groups, made for this group
alone on a ``TCPStore`` that rank 0 serves on a free port of 127.0.0.1 (so
one process may hold several groups): gloo for the step's arrays, and for the
model's collectives on the CPU; NCCL for those on CUDA. A rank starts as
``python -m batchgen.worker.engine.tensor_rank`` with its settings on stdin
and dies with rank 0 (``PR_SET_PDEATHSIG``). Until every rank has begun to
join (``JOINING`` in the store), rank 0 watches their processes, so one that
exits first fails the start at once with ``GroupLost``, not after gloo's
START_TIMEOUT. A rank that dies, or a
collective that waits longer than ``tensor_parallel_timeout_s``, makes rank
0's step raise ``GroupLost``: the group cannot go on (its ranks may be in
different collectives), so the engine process exits and its supervisor
starts a fresh group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from batchgen.parts import child_environ, module_command
from batchgen.worker.engine.runner.model_runner import HostStep
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.models.tensor_shard import Shard
from batchgen.worker.worker_errors import GroupLost

log = logging.getLogger(__name__)
HOST = "127.0.0.1"
# ranks meet, load their shards and size their KV pools within this (a large checkpoint's
# shard read from a slow disk); each step's collectives then within tensor_parallel_timeout_s
START_TIMEOUT = timedelta(minutes=30)
JOINING = "joining"  # each rank sets JOINING/<rank> in the store as it starts to join
POLL_S = 0.05  # how often rank 0 looks at the ranks it started while they have not joined


def exit_text(code: int) -> str:
    """A rank's exit, its signal named: ``exited with -9 (SIGKILL)``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exited with {code} ({signal.Signals(-code).name})"
    return f"exited with {code}"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """CUDA: rank r runs on the r-th GPU after rank 0's; the CPU: the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


@dataclass(frozen=True, slots=True)
class RankOrder:
    """What rank 0 tells a rank it starts (on stdin: the path may name a private place)."""

    path: str
    config: dict[str, Any]
    rank: int
    port: int


@dataclass(slots=True)
class Collectives:
    """One side of a group: its store, the gloo group the steps travel on, and the shard
    (its rank and the group the model's collectives run on)."""

    store: Any
    control: Any  # ProcessGroupGloo
    shard: Shard
    timeout: timedelta  # a step's collectives; loading (and meeting) may take START_TIMEOUT

    @classmethod
    def join(cls, store: Any, rank: int, world: int, device: torch.device,
             timeout: timedelta) -> Collectives:  # fmt: skip
        store.set(f"{JOINING}/{rank}", b"")  # rank 0 waits for these before it blocks
        control = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, world, START_TIMEOUT
        )
        model_group: Any
        if device.type == "cuda":  # NCCL's own watchdog bounds its collectives
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            model_group = dist.ProcessGroupNCCL(
                dist.PrefixStore("model", store), rank, world, options
            )
        else:
            model_group = dist.ProcessGroupGloo(
                dist.PrefixStore("model", store), rank, world, START_TIMEOUT
            )
        return cls(store, control, Shard(rank, world, model_group, timeout), timeout)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the KV blocks all of them can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # stubs: RedOpType
        self.control.allreduce([t], options).wait()
        return int(t.item())

    def broadcast(self, message: Any, timeout: timedelta) -> Any:
        """Rank 0's ``message`` on every rank (its pickle's size, then its bytes)."""
        if self.shard.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(message)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.control.broadcast(size, 0, timeout).wait()
        if self.shard.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.control.broadcast(data, 0, timeout).wait()
        return message if self.shard.rank == 0 else pickle.loads(data.numpy().tobytes())


def await_joining(store: Any, ranks: list[subprocess.Popen[bytes]]) -> None:
    """Returns once every rank started (rank r is ``ranks[r - 1]``) has begun to join; a rank
    that exits first raises ``GroupLost`` at once, not after gloo's START_TIMEOUT."""
    keys = [f"{JOINING}/{rank}" for rank in range(1, len(ranks) + 1)]
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, proc in enumerate(ranks, 1):
            code = proc.poll()
            if code is not None:
                raise GroupLost(
                    f"tensor-parallel group lost: rank {rank} {exit_text(code)} before it joined"
                )
        if time.monotonic() > deadline:
            raise GroupLost(f"tensor-parallel group lost: ranks not joined in {START_TIMEOUT}")
        time.sleep(POLL_S)


class TensorGroup:
    """Rank 0's side: the ranks it started, and what it sends them each step."""

    def __init__(self, collectives: Collectives, ranks: list[subprocess.Popen[bytes]]) -> None:
        self.collectives = collectives
        self.ranks = ranks  # rank r is ranks[r - 1]
        self.closed = False

    @property
    def shard(self) -> Shard:
        return self.collectives.shard

    @classmethod
    def start(cls, path: str, config: EngineConfig, device: torch.device) -> TensorGroup:
        """Starts ranks 1..N-1 (each loads its shard while this process loads its own) and
        joins them."""
        world = config.tensor_parallel_size
        timeout = timedelta(seconds=config.tensor_parallel_timeout_s)
        store = dist.TCPStore(
            HOST, 0, world, is_master=True, timeout=START_TIMEOUT, wait_for_workers=False
        )
        ranks = []
        for rank in range(1, world):
            order = RankOrder(str(path), asdict(config), rank, store.port)
            proc = subprocess.Popen(
                module_command("batchgen.worker.engine.tensor_rank"), env=child_environ(),
                stdin=subprocess.PIPE,
            )  # fmt: skip
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError), proc.stdin as pipe:
                pipe.write(json.dumps(asdict(order)).encode())
            ranks.append(proc)
        try:
            await_joining(store, ranks)
            collectives = Collectives.join(store, 0, world, device, timeout)
        except BaseException:
            for proc in ranks:
                proc.kill()
            raise
        return cls(collectives, ranks)

    def send(self, host: HostStep) -> None:
        """The step's arrays to every rank, which then run the forward with this one."""
        self._check_alive()
        self.collectives.broadcast(host, self.collectives.timeout)

    def lost(self, exc: BaseException) -> Exception:
        if isinstance(exc, GroupLost):
            return exc
        return self.rank_died(exc) or GroupLost(
            f"tensor-parallel group lost: a collective failed ({type(exc).__name__}: {exc})"
        )

    def rank_died(self, exc: BaseException) -> GroupLost | None:
        """``exc`` as ``GroupLost`` naming the rank that died, if one did (a killed rank's
        peers fail their collectives at once, maybe before its parent hears of it)."""
        for proc in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0 / len(self.ranks))
        dead = self._dead()
        if not dead:
            return None
        rank, code = dead[0]
        return GroupLost(
            f"tensor-parallel group lost: rank {rank} {exit_text(code)} "
            f"({type(exc).__name__}: {exc})"
        )

    def _dead(self) -> list[tuple[int, int]]:
        return [(r, p.returncode) for r, p in enumerate(self.ranks, 1) if p.poll() is not None]

    def _check_alive(self) -> None:
        dead = self._dead()
        if dead:
            rank, code = dead[0]
            raise GroupLost(f"tensor-parallel group lost: rank {rank} {exit_text(code)}")

    def close(self) -> None:
        """Tells the ranks to exit and waits for them (killed if they do not)."""
        if self.closed:
            return
        self.closed = True
        if not self._dead():
            with contextlib.suppress(Exception):
                self.collectives.broadcast(None, timedelta(seconds=10))
        for proc in self.ranks:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
