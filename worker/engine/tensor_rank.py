"""A tensor-parallel rank other than 0: ``python -m batchgen.worker.engine.tensor_rank``.

Rank 0 (``tensor_group.TensorGroup.start``) starts it with a ``RankOrder`` on
stdin; it loads its shard, then runs each step rank 0 sends until told to
stop, and dies with rank 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from batchgen.worker.engine.tensor_group import HOST, START_TIMEOUT, Collectives, RankOrder
from batchgen.worker.engine_config import EngineConfig

log = logging.getLogger(__name__)
# a rank waits this long for rank 0's next step: an idle engine is no hung collective
IDLE_WAIT = timedelta(days=365)
_PR_SET_PDEATHSIG = 1


def run_rank(order: RankOrder) -> int:
    """A rank other than 0: load its shard, then run each step rank 0 sends until told to stop."""
    from batchgen.worker.engine.runner.loading import build_rank_runner

    config = EngineConfig(**order.config)
    timeout = timedelta(seconds=config.tensor_parallel_timeout_s)
    store = dist.TCPStore(
        HOST, order.port, config.tensor_parallel_size, is_master=False, timeout=START_TIMEOUT
    )

    def join(device: torch.device) -> Collectives:
        return Collectives.join(store, order.rank, config.tensor_parallel_size, device, timeout)

    collectives, runner = build_rank_runner(order.path, config, order.rank, join)
    model = runner.model
    while True:
        host = collectives.broadcast(None, IDLE_WAIT)
        if host is None:
            return 0
        ids, positions, batch, rows = runner.stage(host)
        hidden = model.forward(ids, positions, batch, runner.kv_caches)
        if rows.numel():  # rank 0 asks for logits only when it samples: the same rows here
            model.compute_logits(hidden[rows])


def _die_with_parent() -> None:
    """Linux: SIGKILL when rank 0 dies, however it dies."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def main() -> int:
    _die_with_parent()
    order = RankOrder(**json.loads(sys.stdin.read()))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {order.rank} "
                        "%(levelname)s %(message)s", datefmt="%H:%M:%S")  # fmt: skip
    try:
        return run_rank(order)
    except Exception as exc:  # rank 0 is gone or failed: it reports the group lost
        log.error("rank %d stops: %s: %s", order.rank, type(exc).__name__, exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
