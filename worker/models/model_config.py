"""What the model code needs from a checkpoint's config: the decoder's switches, read once.

A family's config reader (``families/``) turns the HF config into a
``ModelConfig``; the decoder (``decoder.py``) is written once and reads these
switches, never the architecture's name. A switch a family cannot honour is
refused when the config is read, by name (``UnsupportedModelError``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class NormKind(str, enum.Enum):
    RMS = "rms"  # x / rms(x) * w
    LAYER = "layer"  # (x - mean) / std * w (+ b)


@dataclass(frozen=True, slots=True)
class NormSpec:
    kind: NormKind
    eps: float
    bias: bool = False  # LayerNorm with a bias
    # Gemma's (1 + w) is folded into the weight when it is read, so no switch here


class QKNormScope(str, enum.Enum):
    HEAD = "head"  # each head's head_dim normalised (Qwen3, Gemma 3, Cohere, StableLM)
    ALL = "all"  # the whole projection normalised (OLMo 2/3)


@dataclass(frozen=True, slots=True)
class QKNormSpec:
    scope: QKNormScope
    norm: NormSpec


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """One rotary table: its HF parameters (rope_theta, rope_type and the scaling's own keys)."""

    parameters: tuple[tuple[str, Any], ...]  # sorted items, so the spec is hashable
    layer_type: str | None  # HF's key when rope_parameters is per layer type (Gemma 3)

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.parameters).get(key, default)

    @property
    def rope_type(self) -> str:
        return str(self.get("rope_type", "default"))


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # on q.k; head_dim ** -0.5 unless the config says otherwise
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: QKNormSpec | None = None
    rotary_dim: int = 0  # the leading head_dim channels that rotate (partial rotary); 0: none
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    sinks: bool = False  # a learned sink logit per head joins each softmax (gpt-oss)


@dataclass(frozen=True, slots=True)
class MlpSpec:
    intermediate_size: int
    activation: str  # a key of ``mlp.ACTIVATIONS``
    gated: bool = True  # act(gate) * up, else act(fc1)
    bias: bool = False


class BlockKind(str, enum.Enum):
    SEQUENTIAL = "sequential"  # h += attn(norm(h)); h += mlp(norm(h))
    PARALLEL = "parallel"  # h += attn(norm(h)) + mlp(norm'(h)) (Phi, Cohere, GPT-NeoX)


@dataclass(frozen=True, slots=True)
class BlockSpec:
    kind: BlockKind = BlockKind.SEQUENTIAL
    pre_norms: bool = True  # a norm before attention and before the MLP (OLMo 2: none)
    post_norms: bool = False  # a norm on attention's and the MLP's output (Gemma 2/3, OLMo 2)
    shared_norm: bool = False  # parallel: attention and MLP read the same norm (Phi, Cohere)
    residual_multiplier: float = 1.0  # Granite: h += residual_multiplier * out


class MlpKind(str, enum.Enum):
    DENSE = "dense"
    MOE = "moe"  # routed experts (``ModelConfig.moe``), plus a shared expert where it has one


class RouterKind(str, enum.Enum):
    SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, then top-k (Mixtral, Qwen-MoE)
    TOPK_SOFTMAX = "topk_softmax"  # top-k logits, softmaxed among themselves (gpt-oss)
    GROUPED_TOPK = "grouped_topk"  # DeepSeek: best groups first, then top-k among them


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The routed experts of the layers whose ``LayerSpec.mlp`` is MOE."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    router: RouterKind
    renormalize: bool = False  # top-k weights rescaled to sum to 1
    router_bias: bool = False  # the router linear has a bias (gpt-oss)
    expert_bias: bool = False  # the experts' projections have biases (gpt-oss)
    clamped_swiglu: tuple[float, float] | None = None  # (alpha, limit): gpt-oss's activation
    # GROUPED_TOPK: groups kept of num_groups; sigmoid scores (V3) or softmax (V2)
    num_groups: int = 1
    topk_group: int = 1
    sigmoid: bool = False
    correction_bias: bool = False  # V3: a per-expert bias on the choice, not the weights
    scaling_factor: float = 1.0  # routed weights times this (DeepSeek's routed_scaling_factor)
    shared_intermediate_size: int = 0  # a shared expert on every token; 0: none
    shared_gate: bool = False  # sigmoid(x @ gate) scales the shared expert (Qwen2-MoE)


@dataclass(frozen=True, slots=True)
class LatentAttentionSpec:
    """DeepSeek's multi-head latent attention (MLA). The cache holds, per token, one
    (kv_lora_rank + qk_rope_head_dim) row shared by every head: ``AttentionSpec`` is
    then one KV head of that dim, rotary_dim the rope part, and K and V the same tensor."""

    q_lora_rank: int | None  # q through a low-rank bottleneck with a norm, or one projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What may differ from one layer to the next."""

    window: int | None = None  # sliding window: a query sees its last `window` keys
    rope: int | None = 0  # index into ModelConfig.ropes; None: this layer has no rotary
    mlp: MlpKind = MlpKind.DENSE


@dataclass(frozen=True, slots=True)
class HeadSpec:
    """From the final hidden state to the logits."""

    bias: bool = False  # lm_head has a bias (Phi)
    scale: float = 1.0  # logits * scale (Cohere's logit_scale, Granite's 1 / logits_scaling)
    softcap: float | None = None  # logits -> softcap * tanh(logits / softcap) (Gemma 2)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # the HF class, e.g. "Gemma2ForCausalLM"
    family: str  # the family that reads it, e.g. "gemma2"
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None
    norm: NormSpec
    attention: AttentionSpec
    mlp: MlpSpec
    block: BlockSpec
    layers: tuple[LayerSpec, ...]
    ropes: tuple[RopeSpec, ...]
    head: HeadSpec
    embedding_scale: float | None = None  # Gemma's sqrt(hidden), Granite's multiplier
    learned_positions: bool = False  # GPT-2: a position embedding added to the token's
    hf_config: Any = None  # the transformers config object (rope init, EOS)
    moe: MoeSpec | None = None  # the experts of MOE layers
    latent: LatentAttentionSpec | None = None  # MLA instead of per-head K/V
    quantization: Any = None  # the checkpoint's quant.Scheme; None: plain weights

    @property
    def kv_shared(self) -> bool:
        """One cache tensor per layer serves as both K and V (MLA's latent)."""
        return self.latent is not None

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(layer.window for layer in self.layers)

    @property
    def release_window(self) -> int | None:
        return release_window(self.windows)


def release_window(windows: tuple[int | None, ...]) -> int | None:
    """The widest window when every layer slides: a sequence's keys older than
    that are read by no layer again. None when any layer attends to everything."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
