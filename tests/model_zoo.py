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
    small: bool = True  # start from SMALL (False: the entry spells its own sizes)

    def kwargs(self) -> dict[str, Any]:
        return {**SMALL, **self.config} if self.small else dict(self.config)


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
