"""What every quantized format provides: a scheme read from the config, and its weights.

A ``Scheme`` is one checkpoint's ``quantization_config``, read: which modules
it quantizes (``quantizes``) and how to take one module's tensors from the
store (``read``). A ``QuantizedWeight`` is one projection's tensors exactly as
the checkpoint stores them, and the rule that turns a run of its output
features back into floats (``dequantize``); the CPU product and the GPU
kernels read the same objects (``kernel``: the op set's GEMM bound to them).
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms


class QuantizedWeight(abc.ABC):
    """One (out_features, in_features) projection in its checkpoint's layout."""

    @property
    @abc.abstractmethod
    def out_features(self) -> int: ...

    @property
    @abc.abstractmethod
    def in_features(self) -> int: ...

    @property
    @abc.abstractmethod
    def column_step(self) -> int:
        """dequantize's start and stop are multiples of this (a scale block's rows)."""

    @abc.abstractmethod
    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        """Output features [start, stop) as fp32, (stop - start, in_features)."""

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """int8 (out, in) values and an fp32 scale per output channel, (out,), or per
        tensor, (1,), where the weight is stored so (W8A8 int8); None otherwise."""
        return None

    def kernel(self, gemms: QuantGemms) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """x (rows, in_features) -> x @ this weight, (rows, out_features), by the op set's GEMM
        for the format, reading the stored tensors; None where none takes them as stored."""
        return None

    @abc.abstractmethod
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The stored tensors (what the weight takes in memory)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class Scheme(abc.ABC):
    """A checkpoint's quantization, as its config states it."""

    method: str  # quant_method as config.json spells it

    @abc.abstractmethod
    def quantizes(self, module: str) -> bool:
        """Whether the module (``model.layers.0.self_attn.q_proj``) is stored quantized."""

    @abc.abstractmethod
    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        """The module's quantized tensors, taken from the store."""

    def check_shape(
        self, store: TensorStore, name: str, tensor: torch.Tensor, shape: tuple[int, ...], of: str
    ) -> None:
        """Refuse the checkpoint, naming tensor ``name``, unless ``tensor`` has ``shape``: every
        format's ``read`` says so in these words, ``of`` saying what makes that shape
        (``"1216 inputs in groups of 128"``)."""
        if tuple(tensor.shape) != shape:
            got = f"{tensor.dtype} {tuple(tensor.shape)}"
            store.refuse(name, f"{got}, not the {shape} {self.method} holds for {of}")

    def activation(
        self, store: TensorStore, module: str
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the module's input goes through first (the quantize-dequantize of W8A8
        schemes, as the reference computes it: dynamic, or with a static scale the store
        holds); None: the input as it is."""
        return None


class Options:
    """A quantization_config's keys, read one by one; any key no one read is refused."""

    def __init__(self, raw: dict[str, Any], method: str) -> None:
        self.raw = raw
        self.method = method
        self.read: set[str] = {"quant_method"}

    def get(self, key: str, default: Any = None, *, allowed: Iterable[Any] | None = None) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        value = default if value is None else value
        if allowed is not None and value not in list(allowed):
            raise self.refuse(key, "batchgen runs " + ", ".join(repr(a) for a in allowed))
        return value

    def refuse(self, key: str, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"quantization_config ({self.method}): {key}={self.raw.get(key)!r} is not "
            f"supported ({why})"
        )

    def check_all_read(self) -> None:
        unread = sorted(k for k, v in self.raw.items() if k not in self.read and v is not None)
        if unread:
            raise UnsupportedModelError(
                f"quantization_config ({self.method}) sets {', '.join(unread)}, which batchgen "
                "does not read; refusing to run it rather than give other tokens"
            )


def transformers_skips(module: str, patterns: tuple[str, ...] | None) -> bool:
    """``modules_to_not_convert`` as transformers matches it
    (``quantizers_utils.should_convert_module``): a pattern matches from the start up to
    a module boundary (also as a regex), or as a suffix of the name."""
    if not patterns:
        return False
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(
        re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns
    )
