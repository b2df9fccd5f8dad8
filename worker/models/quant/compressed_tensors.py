"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, llm-compressor's output).

Formats read, with the tensors each stores per quantized projection (N out, K in):

- ``pack-quantized`` (W4A16, W8A16): ``weight_packed`` int32 (N, K * bits / 32),
  element j of a row at bits [j * bits, (j + 1) * bits) of the row's words, stored
  as value + 2^(bits-1); ``weight_scale`` (N, K / group) or (N, 1);
  ``weight_zero_point`` (asymmetric only) packed the same way down the rows,
  (N * bits / 32, groups); ``weight_shape`` int64 (N, K).
- ``int-quantized`` (int8 W8A8) and ``float-quantized`` (FP8 e4m3): ``weight`` int8 /
  float8_e4m3fn (N, K) with ``weight_scale`` per channel (N, 1) or per tensor.

A weight is ``(q - zero_point) * scale`` computed in the scale's dtype, as
compressed-tensors' ``dequantize`` computes it. Dynamic per-token input
activations (W8A8, FP8-dynamic) are quantized and dequantized the way
compressed-tensors' forward does it (scale = amax / (q_range / 2), rounded and
clamped), so the CPU product equals transformers' decompressed model; the GPU
kernels run the same math on int8/fp8 operands. Static FP8 input scales
(``dynamic: false``, strategy ``tensor``: one ``NAME.input_scale`` per
projection, llm-compressor's FP8 preset) quantize the input with that scale
(``StaticFp8Input``), as compressed-tensors' forward does. Static int8 or
asymmetric input scales, output activations, KV-cache schemes, sparsity,
transforms and any other strategy are refused by name.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.worker.models.quant.packing import unpack
from batchgen.worker.models.quant.scheme import Options, QuantizedWeight, Scheme
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.worker_errors import UnsupportedModelError

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
FP8_MAX = 448.0


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Rows of int32 words -> (rows, count) signed ints (the stored value - 2^(bits-1))."""
    return unpack(packed, bits, dim=1)[:, :count] - (1 << (bits - 1))


@dataclass(frozen=True, slots=True)
class WeightArgs:
    kind: str  # "int" or "float"
    bits: int
    symmetric: bool
    group_size: int | None  # None: one scale per output channel (or per tensor)


@dataclass(slots=True)
class CompressedWeight(QuantizedWeight):
    values: torch.Tensor  # int32 packed (N, words), or int8 / float8_e4m3fn (N, K)
    scale: torch.Tensor  # (N, groups), (N, 1) or (1,)
    zero_point: torch.Tensor | None  # asymmetric: int32 packed down the rows, or int8 (N, groups)
    args: WeightArgs
    shape: tuple[int, int]  # (N, K)
    packed: bool

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def column_step(self) -> int:
        return 32 // self.args.bits if self.packed and self.zero_point is not None else 1

    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        bits, k = self.args.bits, self.in_features
        rows = self.values[start:stop]
        q = unpack_int32(rows, bits, k) if self.packed else rows
        scale = self.scale if self.scale.numel() == 1 else self.scale[start:stop]
        value = q.to(scale.dtype)
        if self.zero_point is not None:
            zp = self.zero_point
            if self.packed:
                per_word = 32 // bits
                words = zp[start // per_word : math.ceil(stop / per_word)].t()
                zp = unpack_int32(words, bits, words.shape[1] * per_word).t()[: stop - start]
            else:
                zp = zp[start:stop]
            value = value - _spread(zp, k).to(scale.dtype)
        return (value * _spread(scale, k)).float()

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.values.dtype != torch.int8 or self.zero_point is not None:
            return None
        if self.scale.numel() != 1 and self.scale.shape != (self.out_features, 1):
            return None
        return self.values, self.scale.float().reshape(-1)

    def kernel(self, gemms: QuantGemms) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """4-bit pack-quantized with a scale per channel or group: the W4A16 GEMM."""
        k = self.in_features
        if not (self.packed and self.args.bits == 4 and self.scale.dim() == 2):
            return None
        if self.values.shape[1] * 8 != k or k % self.scale.shape[1]:
            return None
        return functools.partial(
            gemms.pack_quantized, weight_packed=self.values, weight_scale=self.scale,
            weight_zero_point=self.zero_point,
        )  # fmt: skip

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = () if self.zero_point is None else (self.zero_point,)
        return (self.values, self.scale, *extra)


def _spread(per_group: torch.Tensor, k: int) -> torch.Tensor:
    """(rows, groups) -> (rows, k), each group's value over its columns; (1,) stays."""
    if per_group.dim() < 2:
        return per_group
    return per_group.repeat_interleave(k // per_group.shape[1], dim=1)


@dataclass(frozen=True, slots=True)
class ActivationArgs:
    kind: str  # "int" (int8) or "float" (fp8 e4m3)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Each row quantized with its own dynamic scale and dequantized, as
        compressed-tensors' forward does (``compute_dynamic_scales_and_zp``)."""
        rounded, scale = self.quantize(x)
        return rounded.to(x.dtype) * scale

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's quantized values (int8 kind: whole numbers in [-128, 127], in x's
        dtype; float kind: float8_e4m3fn) and its scale, (rows, 1) in x's dtype."""
        q_min, q_max = (-128.0, 127.0) if self.kind == "int" else (-FP8_MAX, FP8_MAX)
        lo = torch.clamp(x.amin(dim=-1, keepdim=True), max=0)
        hi = torch.clamp(x.amax(dim=-1, keepdim=True), min=0)
        scale = torch.max(lo.abs(), hi) / ((q_max - q_min) / 2)
        scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
        scaled = torch.clamp(x / scale, q_min, q_max)
        rounded = torch.round(scaled) if self.kind == "int" else scaled.to(torch.float8_e4m3fn)
        return rounded, scale


# compressed-tensors' FP8 weights with a scale per output channel (FP8-dynamic's, and what
# --quantization fp8 and fbgemm_fp8 checkpoints store)
FP8_CHANNEL = WeightArgs(kind="float", bits=8, symmetric=True, group_size=None)


@dataclass(frozen=True, slots=True)
class StaticFp8Input:
    """One projection's static input scale (``NAME.input_scale``, one value): the input
    divided by it, clamped to e4m3's range, cast to e4m3 and multiplied back in the
    scale's dtype, as compressed-tensors' ``_quantize_dequantize`` computes it."""

    scale: float  # the stored value, exactly
    dtype: torch.dtype  # the stored scale's dtype, which the math runs in

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([self.scale], dtype=self.dtype, device=x.device)
        q = torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.to(self.dtype) * scale).to(x.dtype)


@dataclass(frozen=True, slots=True)
class Group:
    targets: tuple[str, ...]
    weights: WeightArgs
    activations: ActivationArgs | None  # dynamic per token
    format: str
    static_input: bool = False  # a static FP8 scale per projection instead


@dataclass(frozen=True, slots=True)
class CompressedTensorsScheme(Scheme):
    groups: tuple[Group, ...]
    ignore: tuple[str, ...]
    method: str = "compressed-tensors"

    def quantizes(self, module: str) -> bool:
        return self._group(module) is not None

    def _group(self, module: str) -> Group | None:
        if any(_matches(module, pattern) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(t == "Linear" or _matches(module, t) for t in group.targets):
                return group
        return None

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        group = self._group(module)
        assert group is not None
        args = group.weights
        packed = group.format == "pack-quantized"
        if packed:
            values = store.take_stored(f"{module}.weight_packed")
            n, k = (int(v) for v in store.take_stored(f"{module}.weight_shape").tolist())
        else:
            values = store.take_stored(f"{module}.weight")
            n, k = values.shape
            want = torch.int8 if args.kind == "int" else torch.float8_e4m3fn
            if values.dtype != want:
                store.refuse(f"{module}.weight", f"{values.dtype}, the config says {want}")
        scale = store.take_stored(f"{module}.weight_scale")
        zero_point = None if args.symmetric else store.take_stored(f"{module}.weight_zero_point")
        if args.group_size is not None and k % args.group_size:
            store.refuse(f"{module}.weight_scale", f"{k} inputs in groups of {args.group_size}")
        groups = 1 if args.group_size is None else k // args.group_size
        if scale.numel() != 1:  # else one scale for the whole tensor
            of = f"{n} outputs by {groups} groups of inputs"
            self.check_shape(store, f"{module}.weight_scale", scale, (n, groups), of)
        return CompressedWeight(values, scale, zero_point, args, (n, k), packed)

    def activation(
        self, store: TensorStore, module: str
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        group = self._group(module)
        if group is None or not group.static_input:
            return None if group is None else group.activations
        scale = store.take_stored(f"{module}.input_scale")
        if scale.numel() != 1 or not scale.is_floating_point():
            store.refuse(
                f"{module}.input_scale", f"{scale.dtype} {tuple(scale.shape)}, not one scale"
            )
        return StaticFp8Input(float(scale.reshape(())), scale.dtype)


def _matches(module: str, pattern: str) -> bool:
    """A name as compressed-tensors matches targets and ignores: exactly, or a ``re:`` regex."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern


def _weight_args(raw: dict[str, Any], fmt: str) -> WeightArgs:
    o = Options(raw, "compressed-tensors weights")
    kind = o.get("type", "int", allowed=["int", "float"])
    bits = o.get("num_bits", 8, allowed=[4, 8] if kind == "int" else [8])
    strategy = o.get("strategy", allowed=["channel", "group", "tensor"])
    symmetric = o.get("symmetric", True)
    group = o.get("group_size")
    if strategy == "group" and not (isinstance(group, int) and group > 0):
        raise o.refuse("group_size", "group strategy needs a positive group size")
    if strategy != "group" and group not in (None, -1):
        raise o.refuse("group_size", f"a group size with strategy {strategy!r}")
    group = group if strategy == "group" else None
    o.get("dynamic", False, allowed=[False])
    o.get("actorder", None, allowed=[None, "static"])  # static: the order is undone on save
    o.get("block_structure", None, allowed=[None])
    for harmless in ("observer", "observer_kwargs", "scale_dtype", "zp_dtype"):
        o.get(harmless)  # calibration settings; the stored tensors carry their outcome
    o.check_all_read()
    wants = {"pack-quantized": "int", "int-quantized": "int", "float-quantized": "float"}[fmt]
    if kind != wants or (fmt == "int-quantized" and bits != 8):
        raise UnsupportedModelError(
            f"quantization_config (compressed-tensors): {kind} {bits}-bit weights in "
            f"format {fmt!r} are not supported"
        )
    if kind == "float" and not symmetric:
        raise o.refuse("symmetric", "FP8 weights are symmetric")
    return WeightArgs(kind, bits, bool(symmetric), group)


def _activation_args(raw: dict[str, Any] | None) -> ActivationArgs | bool | None:
    """Dynamic per-token args; True for a static FP8 scale per tensor; None: none."""
    if raw is None:
        return None
    o = Options(raw, "compressed-tensors input_activations")
    kind = o.get("type", "int", allowed=["int", "float"])
    o.get("num_bits", 8, allowed=[8])
    dynamic = o.get("dynamic", allowed=[True, False])
    if dynamic:
        o.get("strategy", allowed=["token"])
    else:  # static: one FP8 scale per projection, stored with it
        o.get("strategy", allowed=["tensor"])
        if kind != "float":
            raise o.refuse("type", "static input scales run for FP8 inputs")
    o.get("symmetric", True, allowed=[True])
    o.get("group_size", None, allowed=[None])
    for harmless in ("observer", "observer_kwargs", "actorder", "block_structure",
                     "scale_dtype", "zp_dtype"):  # fmt: skip
        o.get(harmless)
    o.check_all_read()
    return ActivationArgs(kind) if dynamic else True


def read_compressed_tensors(raw: dict[str, Any]) -> CompressedTensorsScheme:
    o = Options(raw, "compressed-tensors")
    o.get("quantization_status", allowed=["compressed"])
    default_format = o.get("format")
    for absent in ("kv_cache_scheme", "transform_config", "sparsity_config", "moe_sparsity_config"):
        if o.get(absent):
            raise o.refuse(absent, "batchgen runs none")
    for harmless in ("version", "global_compression_ratio"):
        o.get(harmless)
    groups = []
    for name, group in (o.get("config_groups") or {}).items():
        g = Options(group, f"compressed-tensors config_groups.{name}")
        fmt = g.get("format") or default_format
        if fmt not in FORMATS:
            raise UnsupportedModelError(
                f"quantization_config (compressed-tensors): format {fmt!r} is not supported; "
                f"batchgen runs {', '.join(FORMATS)}"
            )
        if g.get("output_activations") is not None:
            raise g.refuse("output_activations", "quantized outputs")
        if g.get("weights") is None:
            raise g.refuse("weights", "activation-only quantization")
        weights = _weight_args(g.get("weights"), fmt)
        activations = _activation_args(g.get("input_activations"))
        if activations is True and weights.kind != "float":
            raise g.refuse("input_activations", "static FP8 input scales with FP8 weights")
        targets = tuple(g.get("targets") or ())
        g.check_all_read()
        dynamic = activations if isinstance(activations, ActivationArgs) else None
        groups.append(Group(targets, weights, dynamic, fmt, static_input=activations is True))
    if not groups:
        raise o.refuse("config_groups", "no quantized group")
    ignore = tuple(o.get("ignore") or ())
    o.check_all_read()
    return CompressedTensorsScheme(tuple(groups), ignore)
