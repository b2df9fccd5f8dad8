"""Which implementation runs a checkpoint: batchgen's own code or transformers' modules.

``model_impl`` (EngineConfig, ``--model-impl``): "native" is a native family
or its refusal; "transformers" is the backend (``hf_backend/``) or its
refusal; "auto" is the native family when one reads the architecture and
honours every switch of the config, else the backend when it can run the
model exactly, else the refusal, naming the architecture and the reason.
Decided on the config alone, before the tokenizer or any weight is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from batchgen.worker.models.hf_backend import HfCausalLM
from batchgen.worker.models.hf_config import HFConfig
from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.registry import find_family, read_native_config
from batchgen.worker.worker_errors import UnsupportedModelError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Implementation:
    native: ModelConfig | None  # None: the transformers backend runs it
    max_positions: int | None  # the longest context that runs exactly; None: unknown
    # why the native family that reads the architecture refused it (auto fell back)
    native_refusal: str | None = None

    def refusal(self, backend: UnsupportedModelError) -> UnsupportedModelError:
        """The backend's refusal at load, after the native one when auto fell back."""
        if self.native_refusal is None:
            return backend
        return UnsupportedModelError(f"{self.native_refusal}; through transformers: {backend}")


def choose_implementation(hf: HFConfig, model_impl: str) -> Implementation:
    if model_impl == "native" or (model_impl == "auto" and find_family(hf) is not None):
        try:
            native = read_native_config(hf)
            return Implementation(native, native.max_position_embeddings)
        except UnsupportedModelError as refusal:
            if model_impl == "native":
                raise
            try:
                backend = _backend(hf, str(refusal))
            except UnsupportedModelError as also:
                raise UnsupportedModelError(f"{refusal}; through transformers: {also}") from also
            log.info("%s; transformers' own modules run it instead (the backend)", refusal)
            return backend
    return _backend(hf)


def _backend(hf: HFConfig, native_refusal: str | None = None) -> Implementation:
    return Implementation(None, HfCausalLM.check_config(hf.hf)[1], native_refusal)
