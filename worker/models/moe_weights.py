"""Reading an MoE layer's tensors (router, experts, shared expert) into a ``SparseMoe``.

Checkpoints name each expert's projections separately
(``{block}.experts.{e}.{gate,up,down}``, transformers' saved layout for
Mixtral, Qwen-MoE and DeepSeek), or, for gpt-oss, hold all experts in two
stacked tensors with gate and up interleaved column by column. Either way the
experts become ``ExpertWeights`` (``kernels/experts.py``): input-major, gate
half then up half. gpt-oss's MXFP4 checkpoints keep their experts as stored
(``Mxfp4ExpertWeights``, read by ``quant/mxfp4.py``), as do block-FP8, GPTQ, AWQ and
compressed-tensors ones (``quant/quantized_experts.py``). The router is read plain: a
checkpoint whose quantization covers it (not in its ignore list or
``modules_to_not_convert``) and stores it quantized is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.kernels.experts import (
    ClampedSwiGLU,
    ExpertWeights,
    Mxfp4ExpertWeights,
    RoutedExperts,
)
from batchgen.worker.models.dense_weights import BlockReader, CheckpointLayout
from batchgen.worker.models.layers.mlp import DenseMlp
from batchgen.worker.models.layers.sparse_moe import Router, SparseMoe, route_fn
from batchgen.worker.models.model_config import MlpSpec, ModelConfig, MoeSpec, RouterKind
from batchgen.worker.models.quant import read_quantized
from batchgen.worker.models.quant.mxfp4 import read_mxfp4_experts
from batchgen.worker.models.quant.quantized_experts import read_quantized_experts
from batchgen.worker.models.tensor_store import TensorStore
from batchgen.worker.models.weights import Linear, fuse
from batchgen.worker.worker_errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class MoeLayout:
    """Where an MoE block's tensors are, relative to the layer's prefix."""

    block: str = "mlp"  # Mixtral: block_sparse_moe
    router: str = "gate"  # gpt-oss: router
    gate: str = "gate_proj"  # an expert's projections; Mixtral: w1, w3, w2
    up: str = "up_proj"
    down: str = "down_proj"
    stacked: bool = False  # gpt-oss: experts.gate_up_proj (E, hidden, 2 * inter) interleaved
    shared: str = "shared_expert"  # DeepSeek: shared_experts
    shared_gate: str = "shared_expert_gate"


def moe_reader(layout: MoeLayout) -> BlockReader:
    """``read_dense``'s reader of MoE layers' MLPs for a family with this layout."""

    def read(store: TensorStore, config: ModelConfig, p: str, layer: int) -> SparseMoe:
        return read_moe(store, config, layout, p)

    return read


def read_moe(store: TensorStore, config: ModelConfig, layout: MoeLayout, p: str) -> SparseMoe:
    """The MoE block of the layer whose tensors start with ``p``."""
    spec = config.moe
    assert spec is not None
    b = f"{p}{layout.block}."
    in_fp32 = spec.router is RouterKind.GROUPED_TOPK  # DeepSeek's router runs in fp32
    _check_router_plain(store, f"{b}{layout.router}")
    router_weight = store.take(f"{b}{layout.router}.weight", float32=in_fp32).t().contiguous()
    router_bias = store.take_if(spec.router_bias, f"{b}{layout.router}.bias")
    correction = None
    if spec.correction_bias:
        correction = store.take(f"{b}{layout.router}.e_score_correction_bias", float32=True)
    router = Router(Linear(router_weight, router_bias), route_fn(spec, correction), in_fp32)
    experts = (
        _stacked_experts(store, spec, config.hidden_size, b)
        if layout.stacked
        else (_expert_by_expert(store, spec.num_experts, b, layout))
    )
    if spec.clamped_swiglu is not None:
        experts.activation = ClampedSwiGLU(*spec.clamped_swiglu)
    moe = SparseMoe(router, experts)
    if spec.shared_intermediate_size:
        s = f"{b}{layout.shared}."
        shared_spec = MlpSpec(spec.shared_intermediate_size, config.mlp.activation)
        up = _projection(store, [f"{s}gate_proj", f"{s}up_proj"])
        moe.shared = DenseMlp(shared_spec, up, _projection(store, [f"{s}down_proj"]))
        if spec.shared_gate:
            moe.shared_gate = _projection(store, [f"{b}{layout.shared_gate}"])
    return moe


def _check_router_plain(store: TensorStore, router: str) -> None:
    scheme = store.quantization
    if scheme is not None and scheme.quantizes(router) and not store.has(f"{router}.weight"):
        raise UnsupportedModelError(
            f"quantization_config ({scheme.method}) quantizes the MoE router {router}; "
            "batchgen reads routers plain (as the releases store them, listed in "
            "ignore / modules_to_not_convert)"
        )


def _projection(store: TensorStore, names: list[str]) -> Linear:
    """The modules ``names`` fused in that order: quantized where the checkpoint is."""
    quantized = read_quantized(store, names, False, CheckpointLayout())
    if quantized is not None:
        return quantized
    return fuse(store.take_all(f"{n}.weight" for n in names))


def _expert_by_expert(
    store: TensorStore, num_experts: int, b: str, layout: MoeLayout
) -> RoutedExperts:
    names = [
        (f"{b}experts.{e}.{layout.gate}", f"{b}experts.{e}.{layout.up}",
         f"{b}experts.{e}.{layout.down}")
        for e in range(num_experts)
    ]  # fmt: skip
    quantized = read_quantized_experts(store, names)
    if quantized is not None:
        return quantized
    w13, w2 = [], []
    for expert in names:
        gate, up, down = store.take_all(f"{n}.weight" for n in expert)
        w13.append(torch.cat((gate, up)).t())  # (hidden, 2 * inter)
        w2.append(down.t())  # (inter, hidden)
    return ExpertWeights(torch.stack(w13).contiguous(), torch.stack(w2).contiguous())


def _stacked_experts(
    store: TensorStore, spec: MoeSpec, hidden: int, b: str
) -> ExpertWeights | Mxfp4ExpertWeights:
    """gpt-oss: columns alternate gate, up; made gate half then up half (MXFP4: as stored)."""
    num_experts = spec.num_experts
    quantized = read_mxfp4_experts(
        store, f"{b}experts", num_experts, hidden, spec.intermediate_size
    )
    if quantized is not None:
        return quantized
    gate_up = store.take(f"{b}experts.gate_up_proj")  # (E, hidden, 2 * inter)
    gate_up_bias = store.take(f"{b}experts.gate_up_proj_bias")  # (E, 2 * inter)
    w13 = torch.cat((gate_up[..., ::2], gate_up[..., 1::2]), dim=-1).contiguous()
    b13 = torch.cat((gate_up_bias[..., ::2], gate_up_bias[..., 1::2]), dim=-1).contiguous()
    w2 = store.take(f"{b}experts.down_proj").contiguous()  # (E, inter, hidden)
    b2 = store.take(f"{b}experts.down_proj_bias").contiguous()  # (E, hidden)
    if w13.shape[0] != num_experts:
        store.refuse(
            f"{b}experts.gate_up_proj", f"{w13.shape[0]} experts, config says {num_experts}"
        )
    return ExpertWeights(w13, w2, b13, b2)
