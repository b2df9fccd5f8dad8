"""Tiny checkpoints of every architecture the tests claim, built offline by transformers.

``ZOO`` maps a name to an HF model_type and the config switches that make it
that variant (every architectural switch of the family on: windows smaller
than the test prompts, soft-caps, biases, partial rotary...). ``build``
writes the checkpoint (random weights from ``batchgen.toy.randomise``, so
norms and biases matter; safetensors; the toy tokenizer; a generation
config) into a directory. Tests get them through the ``zoo_model`` fixture
(conftest.py), which builds each once per session.

Sizes are tiny (hidden 64, head_dim 16, 2-4 layers, vocab 512) so that an
architecture's parity test takes seconds. Other families add entries here.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VOCAB = 512
EOS_ID = 0  # the toy tokenizer's <|endoftext|>
IM_END_ID = 2

# the sizes every entry starts from; an entry's own kwargs override them
SMALL: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=EOS_ID,
    pad_token_id=EOS_ID,
)


@dataclass(frozen=True)
class ZooEntry:
    model_type: str
    config: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # keys of SMALL the model type's config class does not have

    def kwargs(self) -> dict[str, Any]:
        small = {k: v for k, v in SMALL.items() if k not in self.drop}
        return {**small, **self.config}


# gated DeltaNet sizes (the defaults are a real model's: 16 and 32 heads of 128)
TINY_DELTANET: dict[str, Any] = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def _rope(theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **extra}


def _yarn(theta: float, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "yarn", "rope_theta": theta, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "original_max_position_embeddings": 128, **extra}  # fmt: skip


# DeepSeek's shapes: MLA (K/V heads are every head, head_dim is the rope part), 8 experts
# in 4 groups, the first layer dense
MLA: dict[str, Any] = dict(
    num_hidden_layers=3, num_key_value_heads=4, head_dim=8, kv_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=96,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
    topk_group=2, first_k_dense_replace=1,
)  # fmt: skip

ZOO: dict[str, ZooEntry] = {
    "llama": ZooEntry("llama", dict(rope_parameters=_rope(500000.0))),
    # dynamic NTK: transformers rescales only past max_position_embeddings
    "llama-dynamic": ZooEntry(
        "llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    ),
    # item 1 of issue 22: these loaded and silently dropped their o_proj / MLP biases
    "llama-biases": ZooEntry("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen3-bias": ZooEntry("qwen3", dict(attention_bias=True)),
    "qwen3": ZooEntry("qwen3", dict(tie_word_embeddings=True)),
    # every layer slides: blocks that left the window are handed back
    "mistral": ZooEntry("mistral", dict(sliding_window=16)),
    # layers from max_window_layers on slide, the first attends to everything
    "qwen2": ZooEntry(
        "qwen2",
        dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "gemma": ZooEntry("gemma", dict(tie_word_embeddings=True)),
    # local layers (window 16) between global ones, both soft-caps
    "gemma2": ZooEntry(
        "gemma2",
        dict(
            num_hidden_layers=3,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
        ),
    ),
    # q/k norms, a rotary base of its own for local layers, global ones every 3rd layer
    "gemma3": ZooEntry(
        "gemma3_text",
        dict(
            num_hidden_layers=3,
            sliding_window=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": _rope(10000.0),
                "full_attention": _rope(1000000.0),
            },
        ),
    ),
    # parallel block, partial rotary, q/k LayerNorms, biased LM head
    "phi": ZooEntry(
        "phi",
        dict(
            qk_layernorm=True,
            hidden_act="gelu_new",
            rope_parameters=_rope(partial_rotary_factor=0.5),
        ),
    ),
    "phi3": ZooEntry("phi3", dict(sliding_window=24)),
    # longrope: exact up to original_max_position_embeddings, where its short factors end
    "phi3-longrope": ZooEntry(
        "phi3",
        dict(
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "original_max_position_embeddings": 256,
                "short_factor": [1.0 + i / 8 for i in range(8)],
                "long_factor": [2.0 + i for i in range(8)],
            },
        ),
    ),
    # use_parallel_residual with two norms, q/k/v stored head by head, partial rotary
    "gpt_neox": ZooEntry(
        "gpt_neox",
        dict(
            attention_bias=True,
            hidden_act="gelu",
            rope_parameters=_rope(partial_rotary_factor=0.25),
        ),
        drop=("num_key_value_heads", "head_dim"),
    ),
    "stablelm": ZooEntry(
        "stablelm",
        dict(
            num_key_value_heads=4,
            qk_layernorm=True,
            use_qkv_bias=True,
            rope_parameters=_rope(partial_rotary_factor=0.25),
        ),
    ),
    "granite": ZooEntry(
        "granite",
        dict(
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.1,
            logits_scaling=2.0,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
    "cohere": ZooEntry(
        "cohere",
        dict(use_qk_norm=True, logit_scale=0.5, attention_bias=True, tie_word_embeddings=True),
    ),
    "olmo2": ZooEntry("olmo2", dict(attention_bias=True)),
    "olmo3": ZooEntry(
        "olmo3",
        dict(
            num_hidden_layers=3,
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "exaone4": ZooEntry(
        "exaone4",
        dict(
            num_hidden_layers=3,
            sliding_window=16,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "smollm3": ZooEntry("smollm3", dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1])),
    "glm": ZooEntry("glm"),
    "glm4": ZooEntry("glm4"),
    "starcoder2": ZooEntry("starcoder2", dict(sliding_window=24, use_bias=True)),
    "gpt2": ZooEntry(
        "gpt2",
        dict(n_inner=128, activation_function="gelu_new", bos_token_id=EOS_ID),
        drop=("num_key_value_heads", "head_dim", "intermediate_size"),
    ),
    # MoE: dense layers between sparse ones, shared experts and their gate, renormalised
    # and raw top-k weights, gpt-oss's sinks, biases, clamped SwiGLU, yarn and window 8,
    # DeepSeek's MLA with and without q LoRA, grouped routing and V3's correction bias
    "mixtral": ZooEntry("mixtral", dict(
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters=_rope(1e6),
    )),
    "qwen2_moe": ZooEntry("qwen2_moe", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
        rope_parameters=_rope(1e6),
    )),
    "qwen3_moe": ZooEntry("qwen3_moe", dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[],
        rope_parameters=_rope(1e6),
    )),
    "gpt_oss": ZooEntry("gpt_oss", dict(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], attention_bias=True,
        rope_parameters=_yarn(150000.0, truncate=False),
    )),
    "deepseek_v2": ZooEntry("deepseek_v2", dict(
        **MLA, q_lora_rank=None, n_shared_experts=1, routed_scaling_factor=1.5,
        topk_method="group_limited_greedy", rope_parameters=_rope(),
    )),
    "deepseek_v3": ZooEntry("deepseek_v3", dict(
        **MLA, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_interleave=True,
        rope_parameters=_yarn(10000.0, mscale=1.0, mscale_all_dim=1.0),
    )),
    # run by the transformers backend (worker/models/hf_backend/): batchgen has no code of
    # its own for these; each with the switches that set it apart turned on
    # partial rotary on interleaved pairs
    "gptj": ZooEntry("gptj", dict(n_inner=128, rotary_dim=8), drop=("num_key_value_heads",)),
    # learned positions (offset 2), embeddings projected to and from a smaller width
    "opt": ZooEntry("opt", dict(ffn_dim=128, word_embed_proj_dim=32)),
    # multi-query attention: one K/V head
    "gpt_bigcode": ZooEntry(
        "gpt_bigcode", dict(n_inner=128, multi_query=True), drop=("num_key_value_heads",)
    ),
    # per-head q/k LayerNorm, partial rotary, squared ReLU
    "persimmon": ZooEntry(
        "persimmon",
        dict(
            qk_layernorm=True, hidden_act="relu2", rope_parameters=_rope(partial_rotary_factor=0.5)
        ),
    ),
    "olmo": ZooEntry("olmo", dict(clip_qkv=2.0)),  # non-parametric LayerNorm, q/k/v clipped
    "nemotron": ZooEntry("nemotron", dict(rope_parameters=_rope(partial_rotary_factor=0.5))),
    # a switch the native GPT-2 refuses: auto runs it through the backend instead
    "gpt2-layer-scaled": ZooEntry(
        "gpt2",
        dict(n_inner=128, activation_function="gelu_new", scale_attn_by_inverse_layer_idx=True),
        drop=("num_key_value_heads", "head_dim", "intermediate_size"),
    ),
    # hybrids: gated DeltaNet layers (a recurrent state per sequence) before a full-attention
    # layer with a gated output, q/k norms and partial rotary; Qwen3-Next's MLP is MoE
    "qwen3_5": ZooEntry("qwen3_5_text", dict(num_hidden_layers=4, **TINY_DELTANET)),
    "qwen3_next": ZooEntry(
        "qwen3_next",
        dict(
            num_hidden_layers=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **TINY_DELTANET,
        ),
    ),
    # Falcon: its attention goes through transformers' registry from 5.25 (refused before);
    # multi-query with parallel attention and MLP (Falcon-7B), grouped K/V with two
    # layer norms (new_decoder_architecture: Falcon-40B/180B), sequential with biases
    "falcon": ZooEntry("falcon", drop=("head_dim",)),
    "falcon-new-decoder": ZooEntry(
        "falcon", dict(new_decoder_architecture=True, num_kv_heads=2), drop=("head_dim",)
    ),
    "falcon-bias": ZooEntry(
        "falcon", dict(bias=True, parallel_attn=False, multi_query=False), drop=("head_dim",)
    ),
    "falcon-alibi": ZooEntry("falcon", dict(alibi=True), drop=("head_dim",)),
    # refused by the backend: attention outside transformers' registry; a state-space model
    "xglm-refused": ZooEntry(
        "xglm",
        dict(d_model=64, num_layers=2, attention_heads=4, ffn_dim=128),
        drop=("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "intermediate_size", "tie_word_embeddings"),
    ),
    "mamba-refused": ZooEntry("mamba", dict(state_size=4)),
    # a sliding_window transformers' Llama ignores in its mask (while its cache would slide)
    "llama-sliding-refused": ZooEntry("llama", dict(sliding_window=16)),
}  # fmt: skip
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"]


def build(name: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Writes ZOO[name]'s checkpoint into out_dir with the tokenizer files of tokenizer_dir."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    from batchgen.toy import randomise

    hf_logging.disable_progress_bar()
    entry = ZOO[name]
    config = AutoConfig.for_model(entry.model_type, **entry.kwargs())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, config.hidden_size, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=EOS_ID, do_sample=False
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    for file in tokenizer_dir.iterdir():
        shutil.copy(file, out_dir / file.name)
    return out_dir


def build_tokenizer(out_dir: Path) -> Path:
    from batchgen.toy.tokenizer import train_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir, vocab_size=VOCAB, model_max_length=4096)
    return out_dir
