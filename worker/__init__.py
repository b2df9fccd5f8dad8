"""Data plane: the generation engine and the queue loop that feeds it.

``from batchgen.worker import Engine, EngineConfig, SamplingParams, StructuredOutput``
is the Python API. The names load on first use, so the worker supervisor
(``batchgen.worker.loop``) starts without importing torch; ``EngineConfig``
itself lives in the torch-free ``batchgen.worker.engine_config``.

Importing it sets a short OpenMP spin (``GOMP_SPINCOUNT=10000``) where
torch's OpenMP is not loaded yet and no wait policy is set
(``cpu_threads.py``: long-spinning threads cost many times their work on a
busy machine, and OpenMP reads the policy only when it loads): import
``batchgen.worker`` before torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchgen.worker.cpu_threads import quiet_openmp_waits

if TYPE_CHECKING:
    from batchgen.worker.engine import (
        Engine,
        EngineConfig,
        EngineStats,
        FinishReason,
        InvalidEngineConfig,
        RequestOutput,
        RequestRejected,
        Sample,
        SamplingParams,
        StructuredOutput,
    )

quiet_openmp_waits()

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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("batchgen.worker.engine"), name)
    raise AttributeError(f"module 'batchgen.worker' has no attribute {name!r}")
