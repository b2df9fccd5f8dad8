"""The generation engine: continuous batching over a paged KV cache."""

from batchgen.jobs.schema.constraints import StructuredOutput
from batchgen.worker.engine.engine import Engine
from batchgen.worker.engine.outputs import EngineStats
from batchgen.worker.engine.request import EngineFinishReason, RequestOutput, Sample
from batchgen.worker.engine.sampling_params import SamplingParams
from batchgen.worker.engine_config import EngineConfig
from batchgen.worker.worker_errors import GroupLost, InvalidEngineConfig, RequestRejected

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineFinishReason",
    "EngineStats",
    "GroupLost",
    "InvalidEngineConfig",
    "RequestOutput",
    "RequestRejected",
    "Sample",
    "SamplingParams",
    "StructuredOutput",
]
