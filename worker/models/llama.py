"""The Llama family written once: Llama (incl. Llama-3 rope), Mistral, Qwen2, Qwen3.

GQA, attention bias (Qwen2), per-head q/k RMSNorm (Qwen3) and tied
embeddings are switches read from the config at load time, not branches on
the architecture name in the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.kernels import AttentionBatch, KernelOps
from batchgen.worker.models.model_config import ModelConfig
from batchgen.worker.models.rope import rope_tables
from batchgen.worker.models.weights import ModelWeights, linear


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        ops: KernelOps,
        max_positions: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.cos, self.sin = rope_tables(config, max_positions, device)
        self.scale = config.head_dim**-0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions (num_tokens,) -> final hidden states (num_tokens, hidden)."""
        cfg, ops, w = self.config, self.ops, self.weights
        num_tokens = input_ids.shape[0]
        eps = cfg.rms_norm_eps
        hidden = F.embedding(input_ids, w.embed)  # (T, hidden)
        # planned once: every layer attends over the same sequences
        attention = ops.attention(batch, *kv_caches[0], self.scale)
        residual: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(w.layers, kv_caches):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, eps)
            else:
                x, residual = ops.fused_add_rms_norm(hidden, residual, layer.input_norm, eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q = ops.rms_norm(q.reshape(-1, cfg.head_dim), layer.q_norm, eps).view_as(q)
                k = ops.rms_norm(k.reshape(-1, cfg.head_dim), layer.k_norm, eps).view_as(k)
            q, k = ops.apply_rotary(q, k, positions, self.cos, self.sin)
            attn = attention(q, k, v, k_cache, v_cache)
            hidden = linear(attn.reshape(num_tokens, self.q_size), layer.o_proj)
            x, residual = ops.fused_add_rms_norm(hidden, residual, layer.post_norm, eps)
            hidden = linear(ops.silu_and_mul(linear(x, layer.gate_up)), layer.down)
        assert residual is not None
        out, _ = ops.fused_add_rms_norm(hidden, residual, w.final_norm, eps)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, hidden) -> (num_rows, vocab) fp32."""
        return linear(hidden, self.weights.lm_head).float()
