"""Quantized checkpoints, kept quantized in memory: one module per on-disk format.

A checkpoint's ``quantization_config`` is read exactly (``methods.read_quantization``:
one reader per ``quant_method``, every option honoured or refused by name); the
projections it quantizes are read into ``QuantizedLinear`` (``linear.py``), which
holds each projection's tensors in the checkpoint's own layout and dequantizes
them tile by tile inside the product. Modules the config leaves unconverted
(``modules_to_not_convert``, ``ignore``) are read as plain ``Linear``.
"""

from batchgen.worker.models.quant.linear import QuantizedLinear, read_quantized
from batchgen.worker.models.quant.methods import read_quantization
from batchgen.worker.models.quant.scheme import QuantizedWeight, Scheme

__all__ = ["QuantizedLinear", "QuantizedWeight", "Scheme", "read_quantization", "read_quantized"]
