"""The switches most dense families share, read once: ``decoder_config``.

A family calls it with what its transformers code fixes (which biases exist,
the norm, which keys name the epsilon and activation, how windows are
assigned) and then replaces what else differs in the returned config
(``dataclasses.replace``): Gemma its embedding scale, Granite its multipliers.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.families import switches
from batchgen.worker.models.model_config import (
    AttentionSpec,
    BlockKind,
    BlockSpec,
    HeadSpec,
    LayerSpec,
    MlpSpec,
    ModelConfig,
    NormKind,
    NormSpec,
    QKNormScope,
    QKNormSpec,
)


class Windows(str, enum.Enum):
    NONE = "none"  # the family has no sliding window (a config setting one is refused)
    EVERY_LAYER = "every_layer"  # sliding_window applies to every layer (Mistral, Phi-3)
    LAYER_TYPES = "layer_types"  # to the layers layer_types marks sliding_attention


@dataclass(frozen=True, slots=True)
class Shape:
    """What a family's transformers code fixes rather than reads from its config."""

    qkv_bias: bool | None = None  # None: the config's attention_bias says (q/k/v and o alike)
    o_bias: bool | None = None
    mlp_bias: bool | None = None  # None: the config's mlp_bias says
    gated_mlp: bool = True
    norm: NormKind = NormKind.RMS
    norm_bias: bool = False
    norm_eps_key: str = "rms_norm_eps"
    act_key: str = "hidden_act"
    intermediate_key: str = "intermediate_size"  # unset: 4 * hidden (GPT-2's n_inner)
    qk_norm: QKNormScope | None = None
    qk_norm_bias: bool = False
    windows: Windows = Windows.NONE
    rope: bool = True  # False: no rotary at all (GPT-2's learned positions)
    block: BlockSpec = field(default_factory=BlockSpec)


def decoder_config(r: ConfigReader, architecture: str, shape: Shape) -> ModelConfig:
    hidden = switches.positive_int(r, "hidden_size")
    num_layers = switches.positive_int(r, "num_hidden_layers")
    num_heads = switches.positive_int(r, "num_attention_heads")
    head_dim = switches.head_dim(r, hidden, num_heads)
    attention_bias = False
    if shape.qkv_bias is None or shape.o_bias is None:
        attention_bias = bool(r.get("attention_bias", False))
    norm = NormSpec(shape.norm, float(r.require(shape.norm_eps_key)), shape.norm_bias)
    types = ["full_attention"] * num_layers
    if shape.windows is Windows.LAYER_TYPES:
        types = switches.layer_types(r, num_layers)
    layer_windows: list[int | None] = [None] * num_layers
    if shape.windows is not Windows.NONE:
        layer_windows = switches.windows(r, types, every_layer=shape.windows is Windows.EVERY_LAYER)
    if shape.rope:
        ropes, rope_of_type, rotary_dim = switches.ropes(r, head_dim)
        context = switches.context_length(r, ropes)
        layer_ropes: list[int | None] = [switches.rope_of(rope_of_type, t) for t in types]
    else:
        ropes, rotary_dim = (), 0
        context = switches.positive_int(r, "max_position_embeddings")
        layer_ropes = [None] * num_layers
    qk_norm = None
    if shape.qk_norm is not None:
        qk_norm = QKNormSpec(shape.qk_norm, NormSpec(shape.norm, norm.eps, shape.qk_norm_bias))
    return ModelConfig(
        architecture=architecture,
        family=r.family,
        vocab_size=switches.positive_int(r, "vocab_size"),
        hidden_size=hidden,
        num_layers=num_layers,
        max_position_embeddings=context,
        tie_word_embeddings=bool(r.get("tie_word_embeddings", False)),
        torch_dtype=_dtype_name(r),
        norm=norm,
        attention=AttentionSpec(
            num_heads=num_heads,
            num_kv_heads=int(r.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            scale=head_dim**-0.5,
            qkv_bias=attention_bias if shape.qkv_bias is None else shape.qkv_bias,
            o_bias=attention_bias if shape.o_bias is None else shape.o_bias,
            qk_norm=qk_norm,
            rotary_dim=rotary_dim,
        ),
        mlp=MlpSpec(
            intermediate_size=int(r.get(shape.intermediate_key) or 4 * hidden),
            activation=switches.activation(r, shape.act_key),
            gated=shape.gated_mlp,
            bias=bool(r.get("mlp_bias", False)) if shape.mlp_bias is None else shape.mlp_bias,
        ),
        block=shape.block,
        layers=tuple(LayerSpec(window=w, rope=rope) for w, rope in zip(layer_windows, layer_ropes)),
        ropes=ropes,
        head=HeadSpec(),
        hf_config=r.config.hf,
    )


def reader_for(shape: Shape) -> Callable[[ConfigReader, str], ModelConfig]:
    """A family's config reader that is ``decoder_config`` with its shape and nothing more."""

    def read(r: ConfigReader, architecture: str) -> ModelConfig:
        return decoder_config(r, architecture, shape)

    return read


def parallel_block(shared_norm: bool) -> BlockSpec:
    return BlockSpec(kind=BlockKind.PARALLEL, shared_norm=shared_norm)


def _dtype_name(r: ConfigReader) -> str | None:
    dtype = r.get("dtype") or r.get("torch_dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")
