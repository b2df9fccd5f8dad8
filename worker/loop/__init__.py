"""The queue loop: Redis stream entries in, engine requests, Parquet rows out.

It knows nothing of attention; the engine knows nothing of Redis
(docs/architecture.md).
"""

from batchgen.worker.loop.engine_api import EngineAPI, EngineLike
from batchgen.worker.loop.loop_config import LoopConfig
from batchgen.worker.loop.queue_loop import QueueLoop

__all__ = ["EngineAPI", "EngineLike", "LoopConfig", "QueueLoop"]
