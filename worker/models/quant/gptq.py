"""GPTQ checkpoints (``quant_method: gptq``, AutoGPTQ / GPTQModel / optimum's layout).

Per quantized projection (K in, N out): ``qweight`` int32 (K * bits / 32, N), input
rows packed low bits first down each column; ``qzeros`` int32 (groups, N * bits / 32),
packed along the row; ``scales`` (groups, N), fp16 as saved; ``g_idx`` int32 (K,), the
group of each input row (act-order, ``desc_act``, permutes it; without act-order it is
k // group_size, and a checkpoint that omits it means exactly that). The weight is
``(q - zero) * scale`` of the row's group, computed in the scale's dtype (the
kernels' fp16 arithmetic), where ``checkpoint_format: gptq`` stores each zero point
less one (v1, the original packing) and ``gptq_v2`` as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from batchgen.worker.models.quant.packing import unpack
from batchgen.worker.models.quant.scheme import Options, QuantizedWeight, Scheme, transformers_skips
from batchgen.worker.models.tensor_store import TensorStore

if TYPE_CHECKING:
    from batchgen.kernels.ops import QuantGemms

# settings of the calibration run and of transformers' loading (which kernel, batch
# sizes): the stored tensors carry their outcome
_CALIBRATION = (
    "damp_percent", "damp_auto_increment", "true_sequential", "static_groups", "dataset",
    "tokenizer", "batch_size", "model_seqlen", "pad_token_id", "max_input_length",
    "cache_block_outputs", "use_exllama", "exllama_config", "use_cuda_fp16", "backend",
    "model_name_or_path", "model_file_base_name", "quantizer", "meta", "mse", "hyb_act",
    "module_name_preceding_first_block", "block_name_to_quantize", "v2", "v2_alpha",
    "act_group_aware", "fail_safe", "offload_to_disk", "offload_to_disk_path",
)  # fmt: skip


@dataclass(slots=True)
class GptqWeight(QuantizedWeight):
    qweight: torch.Tensor  # int32 (K * bits / 32, N)
    qzeros: torch.Tensor  # int32 (groups, N * bits / 32)
    scales: torch.Tensor  # (groups, N)
    g_idx: torch.Tensor  # (K,) int32
    bits: int
    zero_offset: int  # 1: v1 checkpoints store zero - 1

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def in_features(self) -> int:
        return self.g_idx.shape[0]

    @property
    def column_step(self) -> int:
        return 32 // self.bits

    def dequantize(self, start: int, stop: int) -> torch.Tensor:
        step = self.column_step
        q = unpack(self.qweight[:, start:stop], self.bits, dim=0)  # (K, n)
        zeros = unpack(self.qzeros[:, start // step : -(-stop // step)], self.bits, dim=1)
        zeros = zeros[:, : stop - start] + self.zero_offset  # (groups, n)
        scales = self.scales[:, start:stop]
        groups = self.g_idx.long()
        weight = (q - zeros[groups]).to(scales.dtype) * scales[groups]
        return weight.float().t()

    def kernel(self, gemms: QuantGemms) -> Callable[[torch.Tensor], torch.Tensor] | None:
        k, n, groups = self.in_features, self.out_features, self.scales.shape[0]
        if self.bits != 4 or n % 8:  # the GEMM reads 4-bit words of eight zero points
            return None
        g_idx: torch.Tensor | None = self.g_idx
        in_order = torch.arange(k, device=self.g_idx.device) // max(k // groups, 1)
        if k % groups == 0 and torch.equal(self.g_idx.long(), in_order):
            g_idx = None  # rows in group order: each K step reads its group's scales once
        return functools.partial(
            gemms.gptq, qweight=self.qweight, qzeros=self.qzeros, scales=self.scales,
            g_idx=g_idx, zero_offset=self.zero_offset,
        )  # fmt: skip

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.qweight, self.qzeros, self.scales, self.g_idx)


@dataclass(frozen=True, slots=True)
class GptqScheme(Scheme):
    bits: int
    group_size: int  # -1: one group over all inputs
    desc_act: bool
    zero_offset: int
    not_converted: tuple[str, ...] | None
    method: str = "gptq"

    def quantizes(self, module: str) -> bool:
        return not transformers_skips(module, self.not_converted)

    def read(self, store: TensorStore, module: str) -> QuantizedWeight:
        qweight = store.take_stored(f"{module}.qweight")
        qzeros = store.take_stored(f"{module}.qzeros")
        scales = store.take_stored(f"{module}.scales")
        k = qweight.shape[0] * 32 // self.bits
        if self.desc_act or store.has(f"{module}.g_idx"):
            g_idx = store.take_stored(f"{module}.g_idx")
        else:
            g_idx = torch.arange(k, dtype=torch.int32, device=qweight.device) // self.group_size
        group = k if self.group_size == -1 else self.group_size
        groups = -(-k // group)
        n = qweight.shape[1]
        self.check_shape(
            store, f"{module}.scales", scales, (groups, n), f"{k} inputs in groups of {group}"
        )
        self.check_shape(store, f"{module}.g_idx", g_idx, (k,), f"{k} inputs")
        if qzeros.shape[0] != groups or int(g_idx.max()) >= groups or int(g_idx.min()) < 0:
            store.refuse(f"{module}.g_idx", f"groups outside the {groups} that scales hold")
        return GptqWeight(qweight, qzeros, scales, g_idx, self.bits, self.zero_offset)


def read_gptq(raw: dict[str, Any]) -> GptqScheme:
    o = Options(raw, "gptq")
    bits = o.get("bits", allowed=[4, 8])
    group_size = o.get("group_size", 128)
    if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
        raise o.refuse("group_size", "a positive group size or -1")
    desc_act = bool(o.get("desc_act", False))
    o.get("sym", True)  # the zero points are stored either way
    fmt = o.get("checkpoint_format") or o.get("format") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise o.refuse("checkpoint_format", "batchgen runs 'gptq', 'gptq_v2'")
    o.get("pack_dtype", "int32", allowed=["int32"])
    o.get("is_marlin_format", False, allowed=[False])  # AutoGPTQ's marlin repacking
    o.get("lm_head", False, allowed=[False])
    o.get("modules_in_block_to_quantize", None, allowed=[None])
    for key in _CALIBRATION:
        o.get(key)
    skips = o.get("modules_to_not_convert")
    o.check_all_read()
    return GptqScheme(
        bits, group_size, desc_act, 1 if fmt == "gptq" else 0,
        None if skips is None else tuple(skips),
    )  # fmt: skip
