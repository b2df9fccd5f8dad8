"""One engine process: ``python -m batchgen.worker.loop CONFIG_JSON`` (the supervisor starts it)."""

from __future__ import annotations

import json
import logging
import sys


def main(argv: list[str]) -> int:
    from batchgen.jobs.connection import connect
    from batchgen.jobs.errors import BatchgenError
    from batchgen.worker.loop.config import LoopConfig
    from batchgen.worker.loop.engine_api import load_engine
    from batchgen.worker.loop.runner import QueueLoop

    config = LoopConfig.from_dict(json.loads(argv[1]))
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {config.name} %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        conn = connect(config.redis_url, block_s=config.block_ms / 1000, retries=5)
    except BatchgenError as exc:
        logging.error("%s", exc)
        return 3
    api = load_engine(
        config.model,
        device=config.device,
        max_num_seqs=config.max_num_seqs,
        num_kv_blocks=config.num_kv_blocks,
        max_model_len=config.max_model_len,
    )
    logging.info("serving %s (max_model_len %d)", config.model, api.engine.max_model_len)
    return QueueLoop(conn, api, config).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
