"""Llama-shaped attention with routed experts: Mixtral, Qwen2-MoE, Qwen3-MoE, and what they share.

The attention is Llama's with each family's switches (``decoder_config``); the
MLP of every layer, or of the layers the config makes sparse, is a
``SparseMoe`` (``sparse_moe.py``): softmax top-k routing, Mixtral renormalising the
top-k weights and Qwen as ``norm_topk_prob`` says, Qwen2-MoE adding a shared
expert scaled by its sigmoid gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.decoder import DecoderWeights
from batchgen.worker.models.dense_weights import CheckpointLayout, read_dense
from batchgen.worker.models.families import switches
from batchgen.worker.models.families.decoder_config import Shape, Windows, decoder_config
from batchgen.worker.models.family import Family
from batchgen.worker.models.model_config import (
    MlpKind,
    ModelConfig,
    MoeSpec,
    QKNormScope,
    RouterKind,
)
from batchgen.worker.models.moe_weights import MoeLayout, moe_reader
from batchgen.worker.models.tensor_store import TensorStore

# Keys that only matter in training (the router's auxiliary loss, its jitter) or
# ask for extra outputs (router logits): the forward's tokens do not depend on them.
TRAINING_ONLY = (
    "router_aux_loss_coef", "output_router_logits", "router_jitter_noise", "aux_loss_alpha",
    "seq_aux", "ep_size",
)  # fmt: skip


def num_experts(r: ConfigReader) -> int:
    """Transformers versions and families name the count differently; read every name."""
    names = ("num_local_experts", "num_experts", "n_routed_experts")
    found = {r.get(name) for name in names} - {None}
    if len(found) != 1 or not isinstance(value := found.pop(), int) or value < 1:
        raise r.refuse("num_experts", f"one positive expert count under {', '.join(names)}")
    return value


def read_training_only(r: ConfigReader) -> None:
    for key in TRAINING_ONLY:
        r.extra(key)  # some are fields of transformers' config class, some only of the checkpoints


def with_moe(
    config: ModelConfig, spec: MoeSpec, sparse: list[bool], r: ConfigReader
) -> ModelConfig:
    """``config`` with ``spec``'s experts in the layers ``sparse`` marks."""
    if spec.top_k > spec.num_experts:
        raise r.refuse("num_experts_per_tok", f"at most the {spec.num_experts} experts")
    read_training_only(r)
    layers = tuple(
        dataclasses.replace(layer, mlp=MlpKind.MOE if moe else MlpKind.DENSE)
        for layer, moe in zip(config.layers, sparse)
    )
    return dataclasses.replace(config, moe=spec, layers=layers)


def _qwen_sparse_layers(r: ConfigReader, num_layers: int) -> list[bool]:
    """Qwen-MoE: layer i is sparse unless in mlp_only_layers or (i + 1) % decoder_sparse_step."""
    step = int(r.get("decoder_sparse_step", 1))
    dense = set(r.get("mlp_only_layers", []))
    if step < 1:
        raise r.refuse("decoder_sparse_step", "a positive step")
    return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]


def _read_mixtral(r: ConfigReader, architecture: str) -> ModelConfig:
    shape = Shape(qkv_bias=False, o_bias=False, mlp_bias=False, windows=Windows.EVERY_LAYER)
    config = decoder_config(r, architecture, shape)
    spec = MoeSpec(
        num_experts=num_experts(r),
        top_k=switches.positive_int(r, "num_experts_per_tok"),
        intermediate_size=config.mlp.intermediate_size,  # Mixtral's is the experts'
        router=RouterKind.SOFTMAX_TOPK,
        renormalize=True,
    )
    return with_moe(config, spec, [True] * config.num_layers, r)


def _qwen_moe(r: ConfigReader, config: ModelConfig, shared: bool) -> ModelConfig:
    spec = MoeSpec(
        num_experts=num_experts(r),
        top_k=switches.positive_int(r, "num_experts_per_tok"),
        intermediate_size=switches.positive_int(r, "moe_intermediate_size"),
        router=RouterKind.SOFTMAX_TOPK,
        renormalize=bool(r.get("norm_topk_prob", False)),
        shared_intermediate_size=int(r.get("shared_expert_intermediate_size", 0)) if shared else 0,
        shared_gate=shared,
    )
    if shared and spec.shared_intermediate_size < 1:
        raise r.refuse("shared_expert_intermediate_size", "Qwen2-MoE's shared expert size")
    return with_moe(config, spec, _qwen_sparse_layers(r, config.num_layers), r)


def _read_qwen2_moe(r: ConfigReader, architecture: str) -> ModelConfig:
    qkv_bias = bool(r.get("qkv_bias", True))
    shape = Shape(qkv_bias=qkv_bias, o_bias=False, mlp_bias=False, windows=Windows.LAYER_TYPES)
    config = decoder_config(r, architecture, shape)
    return _qwen_moe(r, config, shared=True)


def _read_qwen3_moe(r: ConfigReader, architecture: str) -> ModelConfig:
    # Qwen3-MoE slides every layer when use_sliding_window is set (transformers
    # clears sliding_window otherwise) and ignores max_window_layers
    r.get("use_sliding_window")
    r.extra("max_window_layers")  # not a field of transformers' Qwen3-MoE config class
    shape = Shape(mlp_bias=False, qk_norm=QKNormScope.HEAD, windows=Windows.EVERY_LAYER)
    config = decoder_config(r, architecture, shape)
    return _qwen_moe(r, config, shared=False)


def moe_weights(
    layout: CheckpointLayout, moe: MoeLayout
) -> Callable[[TensorStore, ModelConfig], DecoderWeights]:
    """A family's weight mapping: ``read_dense`` with its layout, its MoE layers' MLPs read
    from ``moe``."""

    def read(store: TensorStore, config: ModelConfig) -> DecoderWeights:
        return read_dense(store, config, layout, mlp=moe_reader(moe))

    return read


QWEN_MOE_WEIGHTS = moe_weights(CheckpointLayout(), MoeLayout())
MIXTRAL = Family(
    "mixtral", ("MixtralForCausalLM",), _read_mixtral,
    moe_weights(CheckpointLayout(), MoeLayout("block_sparse_moe", gate="w1", up="w3", down="w2")),
)  # fmt: skip
QWEN2_MOE = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), _read_qwen2_moe, QWEN_MOE_WEIGHTS)
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), _read_qwen3_moe, QWEN_MOE_WEIGHTS)
