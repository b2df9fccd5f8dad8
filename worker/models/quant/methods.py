"""From ``quantization_config`` to its ``Scheme``: one reader per ``quant_method``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchgen.worker.models.quant.awq import read_awq
from batchgen.worker.models.quant.compressed_tensors import read_compressed_tensors
from batchgen.worker.models.quant.fbgemm_fp8 import read_fbgemm_fp8
from batchgen.worker.models.quant.fp8 import read_fp8
from batchgen.worker.models.quant.gptq import read_gptq
from batchgen.worker.models.quant.mxfp4 import read_mxfp4
from batchgen.worker.models.quant.scheme import Scheme
from batchgen.worker.worker_errors import UnsupportedModelError

METHODS: dict[str, Callable[[dict[str, Any]], Scheme]] = {
    "fp8": read_fp8,
    "fbgemm_fp8": read_fbgemm_fp8,
    "compressed-tensors": read_compressed_tensors,
    "gptq": read_gptq,
    "awq": read_awq,
    "mxfp4": read_mxfp4,
}


def read_quantization(raw: Any) -> Scheme | None:
    """The scheme config.json's ``quantization_config`` states; None when there is none."""
    if not raw:
        return None
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    reader = METHODS.get(str(method))
    if reader is None:
        raise UnsupportedModelError(
            f"quantization_config: quant_method {method!r} is not supported; batchgen runs "
            + ", ".join(sorted(METHODS))
        )
    return reader(raw)
