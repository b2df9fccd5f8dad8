"""The generation engine: continuous batching over a paged KV cache."""

from batchgen.jobs.structured import StructuredOutput
from batchgen.worker.config import EngineConfig, InvalidEngineConfig
from batchgen.worker.engine.engine import Engine, EngineStats
from batchgen.worker.engine.params import SamplingParams
from batchgen.worker.engine.request import FinishReason, RequestOutput, RequestRejected, Sample

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishReason",
    "InvalidEngineConfig",
    "RequestOutput",
    "RequestRejected",
    "Sample",
    "SamplingParams",
    "StructuredOutput",
]
