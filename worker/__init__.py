"""Data plane: the generation engine and the queue loop that feeds it.

``from batchgen.worker import Engine, SamplingParams`` is the Python API.
"""

from batchgen.worker.engine import (
    Engine,
    EngineStats,
    FinishReason,
    RequestOutput,
    RequestRejected,
    Sample,
    SamplingParams,
)

__all__ = [
    "Engine",
    "EngineStats",
    "FinishReason",
    "RequestOutput",
    "RequestRejected",
    "Sample",
    "SamplingParams",
]
