"""One engine process: ``python -m batchgen.worker.loop < CONFIG_JSON`` (the supervisor starts it).

The LoopConfig comes as JSON on stdin, never as an argument: it holds the Redis
URL with its password, and any local user can read a command line.
"""

from __future__ import annotations

import json
import logging
import sys


def main() -> int:
    from batchgen.jobs.redis.connection import connect
    from batchgen.jobs.schema.errors import BatchgenError, ModelNotLoadable
    from batchgen.worker.loop.engine_api import load_engine
    from batchgen.worker.loop.loop_config import MODEL_REFUSED_EXIT, LoopConfig
    from batchgen.worker.loop.queue_loop import QueueLoop

    config = LoopConfig.from_dict(json.loads(sys.stdin.read()))
    if config.supervised:
        _die_with_parent()
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {config.name} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        conn = connect(config.redis_url, block_s=config.block_ms / 1000, retries=5, wait_s=60)
    except BatchgenError as exc:
        logging.error("%s", exc)
        return 3
    try:
        api = load_engine(config.model, config.engine)
    except ModelNotLoadable as exc:
        print(f"batchgen: error: {exc}", file=sys.stderr, flush=True)
        return MODEL_REFUSED_EXIT
    logging.info("serving %s (max_model_len %d)", config.model, api.engine.max_model_len)
    try:
        return QueueLoop(conn, api, config).run()
    finally:
        api.close()


def _die_with_parent() -> None:
    """Linux: get SIGTERM (and hand work back) if the supervisor dies without telling us."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
