"""MLA's KV cache holds each token's compressed latent and rope key, once, not expanded K/V."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchgen.worker.engine.runner.kv_cache import allocate_kv_cache, bytes_per_block
from batchgen.worker.models.registry import load_model_config

# DeepSeek-V3 (671B) as its config.json has it, minus quantization
DEEPSEEK_V3: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, first_k_dense_replace=3,
    kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, routed_scaling_factor=2.5, norm_topk_prob=True,
    max_position_embeddings=163840,
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
)  # fmt: skip


def test_deepseek_v3_caches_576_values_per_token_and_layer_not_40960(tmp_path: Path):
    from transformers import DeepseekV3Config

    DeepseekV3Config(**DEEPSEEK_V3, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(
        tmp_path
    )
    config = load_model_config(tmp_path)
    assert config.kv_shared and (config.num_kv_heads, config.head_dim) == (1, 512 + 64)
    latent = bytes_per_block(config, block_size=1, dtype=torch.bfloat16)
    assert latent == 61 * 576 * 2 == 70_272  # bytes per token: 68.6 KiB
    # transformers' formulation, expanded: per head a 192-dim key (128 nope + 64 rope)
    # and a 128-dim value
    expanded = 61 * 128 * (192 + 128) * 2
    assert expanded == 4_997_120  # 4.77 MiB per token
    assert round(expanded / latent, 1) == 71.1
    # yarn's mscale (0.1 ln 40 + 1)^2 on the 192-dim heads' scale, as transformers has it
    assert abs(config.attention.scale - 192**-0.5 * (0.1 * 3.6888794541139363 + 1) ** 2) < 1e-12


def test_the_latent_cache_is_one_tensor_read_as_keys_and_values(zoo_model):
    config = load_model_config(zoo_model("deepseek_v3"))
    caches = allocate_kv_cache(config, num_blocks=5, block_size=16, dtype=torch.float32,
                               device=torch.device("cpu"))  # fmt: skip
    assert len(caches) == 3
    for k_cache, v_cache in caches:
        assert k_cache is v_cache
        assert k_cache.shape == (5, 16, 1, 32 + 8)  # kv_lora_rank + qk_rope_head_dim
    assert caches[0][0].data_ptr() != caches[1][0].data_ptr()
    assert bytes_per_block(config, 16, torch.float32) == 3 * 16 * 40 * 4


def test_real_mla_sizes_load_on_the_triton_latent_kernel(tmp_path: Path):
    """A 576-dim latent row for 128 heads is beyond the generic attention kernels' register
    budget, so the latent cache goes to the latent kernel: the load's kernel check passes
    it, and refuses the same shape as separate K and V."""
    from transformers import DeepseekV3Config

    from batchgen.kernels.ops import CPU_OPS, select_ops

    DeepseekV3Config(**DEEPSEEK_V3, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(
        tmp_path
    )
    config = load_model_config(tmp_path)
    a = config.attention
    shape = (a.num_heads, a.num_kv_heads, a.head_dim)
    assert shape == (128, 1, 576) and config.kv_shared
    triton = select_ops(torch.device("cpu"), use_triton=True)
    assert triton.attention_limits(*shape, config.kv_shared) is None
    assert "head_dim 576 with 128 query heads per KV" in str(triton.attention_limits(*shape, False))
    assert "latent (MLA) row of 1024" in str(triton.attention_limits(128, 1, 1024, True))
    assert CPU_OPS.attention_limits(*shape, False) is None
