"""Tiny random MoE checkpoints built offline by transformers from each family's config class.

Every switch the native families read is on somewhere: dense layers between
sparse ones (Qwen ``mlp_only_layers`` and ``decoder_sparse_step``, DeepSeek
``first_k_dense_replace``), the shared expert and its gate, renormalised and
raw top-k weights, gpt-oss's sinks, biases, clamped SwiGLU, yarn rope and
alternating sliding/full layers (window 8, so prompts slide past it),
DeepSeek's q LoRA or plain q projection, grouped routing, V3's correction
bias, interleaved rope and yarn's attention scale. Weights are randomised as
``batchgen toy-model`` does (norms and biases included), with the toy
tokenizer's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")
VOCAB = 512
HIDDEN = 64


def _config(arch: str, eos_id: int) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, bos_token_id=None, eos_token_id=eos_id,
        pad_token_id=eos_id, tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    if arch == "mixtral":
        return tf.MixtralConfig(
            **common, num_hidden_layers=2, intermediate_size=96, num_local_experts=4,
            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=False, mlp_only_layers=[1], decoder_sparse_step=1,
            use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    if arch == "qwen3_moe":
        extra: dict[str, Any] = {"head_dim": 16}  # read by the config, not in its signature
        return tf.Qwen3MoeConfig(
            **common, **extra, num_hidden_layers=3, intermediate_size=96,
            moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            decoder_sparse_step=2, mlp_only_layers=[], use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        )  # fmt: skip
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            **common, num_hidden_layers=2, head_dim=16, intermediate_size=32,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 256,
            },
        )  # fmt: skip
    common["num_key_value_heads"] = 4  # MLA expands K/V to every head, as real configs say
    mla: dict[str, Any] = dict(
        num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    )  # fmt: skip
    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(
            **common, **mla, q_lora_rank=None, n_shared_experts=1, routed_scaling_factor=1.5,
            topk_method="group_limited_greedy",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common, **mla, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_interleave=True,
            rope_parameters={
                "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 256,
            },
        )  # fmt: skip
    raise ValueError(f"unknown MoE architecture {arch!r}; choose one of {', '.join(MOE_ARCHS)}")


def write_moe_checkpoint(out_dir: str | Path, arch: str, seed: int = 0) -> Path:
    """config.json, model.safetensors, generation_config.json and the toy tokenizer in out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    from batchgen.toy.checkpoint import _randomise
    from batchgen.toy.tokenizer import EOS_TOKEN, IM_END, train_tokenizer

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out, vocab_size=VOCAB, model_max_length=1024, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    eos_id = int(tokenizer.convert_tokens_to_ids(EOS_TOKEN))  # type: ignore[arg-type]
    im_end_id = int(tokenizer.convert_tokens_to_ids(IM_END))  # type: ignore[arg-type]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, eos_id), dtype=torch.float32)
    _randomise(model, HIDDEN, seed)
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, im_end_id], pad_token_id=eos_id, do_sample=False
    )
    model.save_pretrained(str(out))
    return out
