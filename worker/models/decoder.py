"""The decoder-only transformer, written once; every family is switches on it.

Which norms a layer has, whether attention and MLP run in parallel, the
embedding and logit scales, learned positions, the attention kind (window,
soft-capping) and rotary of each layer all come from ``ModelConfig`` and
from which modules the family's weight mapping filled in, never from the
architecture's name. The residual stream is kept apart from each block's
output and the two are added where the next norm reads them (one fused op
for RMSNorm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchgen.kernels.batch import AttentionBatch, AttentionKind
from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.layers.mlp import MlpBlock
from batchgen.worker.models.layers.norms import Norm, add_then_norm
from batchgen.worker.models.layers.rope import rope_tables
from batchgen.worker.models.layers.self_attention import AttentionBlock
from batchgen.worker.models.model_config import BlockKind, ModelConfig
from batchgen.worker.models.weights import Linear


@dataclass(slots=True)
class DecoderLayer:
    attention: AttentionBlock
    mlp: MlpBlock
    attn_norm: Norm | None  # before attention; parallel blocks with one norm: the shared one
    mlp_norm: Norm | None  # before the MLP (parallel: the MLP's own, if it has one)
    post_attn_norm: Norm | None = None  # on attention's output (Gemma 2/3, OLMo 2, GLM-4)
    post_mlp_norm: Norm | None = None  # on the MLP's output


@dataclass(slots=True)
class DecoderWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[DecoderLayer]
    final_norm: Norm
    lm_head: Linear  # (hidden, vocab); tied: the embedding's transpose
    position_embed: torch.Tensor | None = None  # (max_positions, hidden), GPT-2


def attention_kinds(config: ModelConfig) -> tuple[list[AttentionKind], list[int]]:
    """The distinct kinds of attention the layers use, and each layer's index into them."""
    kinds: list[AttentionKind] = []
    index = []
    a = config.attention
    for layer in config.layers:
        kind = AttentionKind(scale=a.scale, window=layer.window, softcap=a.softcap)
        if kind not in kinds:
            kinds.append(kind)
        index.append(kinds.index(kind))
    return kinds, index


class Decoder:
    def __init__(
        self,
        config: ModelConfig,
        weights: DecoderWeights,
        ops: KernelOps,
        max_positions: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.ropes = rope_tables(config, max_positions, device)
        self.kinds, self.layer_kind = attention_kinds(config)
        self.parallel = config.block.kind is BlockKind.PARALLEL
        multiplier = config.block.residual_multiplier
        self.residual_multiplier = None if multiplier == 1.0 else multiplier

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
        residual = self.embed_tokens(input_ids)  # (T, hidden)
        if cfg.embedding_scale is not None:
            # in the activations' dtype, as transformers scales it
            residual = residual * torch.tensor(cfg.embedding_scale, dtype=residual.dtype)
        if w.position_embed is not None:
            residual = residual + F.embedding(positions, w.position_embed)
        # planned once per step and kind: every layer of a kind attends over the same sequences
        steps = [ops.attention(batch, *kv_caches[0], kind) for kind in self.kinds]
        delta: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(w.layers, kv_caches)):
            spec = cfg.layers[i]
            rope = None if spec.rope is None else self.ropes[spec.rope]
            attend = steps[self.layer_kind[i]]
            x, residual = add_then_norm(layer.attn_norm, delta, residual, ops)
            attn = layer.attention(x, positions, rope, attend, k_cache, v_cache, ops)
            if self.parallel:
                mlp_in = x if layer.mlp_norm is None else layer.mlp_norm(residual, ops)
                delta = attn + layer.mlp(mlp_in, ops)
                continue
            attn = self._block_output(attn, layer.post_attn_norm)
            x, residual = add_then_norm(layer.mlp_norm, attn, residual, ops)
            delta = self._block_output(layer.mlp(x, ops), layer.post_mlp_norm)
        out, _ = add_then_norm(w.final_norm, delta, residual, ops)
        return out

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(num_tokens,) -> (num_tokens, hidden); a tensor-parallel rank's rows are its
        share of the vocabulary (``tensor_parallel.ShardedDecoder``)."""
        return F.embedding(input_ids, self.weights.embed)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, hidden) -> (num_rows, vocab), before the head's scale and soft-cap."""
        return self.weights.lm_head(hidden)

    def _block_output(self, out: torch.Tensor, post_norm: Norm | None) -> torch.Tensor:
        if post_norm is not None:
            out = post_norm(out, self.ops)
        if self.residual_multiplier is not None:
            out = out * self.residual_multiplier
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, hidden) -> (num_rows, vocab) fp32."""
        head = self.config.head
        logits = self.head_logits(hidden)
        if head.scale != 1.0:
            logits = logits * head.scale
        if head.softcap is not None:
            logits = torch.tanh(logits / head.softcap) * head.softcap
        return logits.float()
