"""batchgen: batch LLM inference over Redis streams, paged KV cache and Parquet sinks.

``from batchgen import Engine, EngineConfig, SamplingParams, StructuredOutput`` is
the Python API (docs/python-api.md). The names load on first use, so the CLI, the
control plane and the worker supervisor start without importing torch;
``EngineConfig`` itself lives in the torch-free ``batchgen.worker.engine_config``.

Importing batchgen sets a short OpenMP spin (``GOMP_SPINCOUNT=10000``) where
torch's OpenMP is not loaded yet and no wait policy is set
(``openmp_waits.py``: long-spinning threads cost many times their
work on a busy machine, and OpenMP reads the policy only when it loads): import
batchgen before torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchgen.openmp_waits import quiet_openmp_waits
from batchgen.parts import find_parts_beside

__version__ = "0.1.0"

# In a source checkout batchgen.worker, .kernels and .jobs are folders beside this one
find_parts_beside()

if TYPE_CHECKING:
    from batchgen.worker.engine import (
        Engine,
        EngineConfig,
        EngineFinishReason,
        EngineStats,
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
    "EngineFinishReason",
    "EngineStats",
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
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
