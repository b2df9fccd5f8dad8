"""A transformers ``*ForCausalLM`` run inside batchgen's engine.

Embeddings, norms, MLPs, rope (at the positions the runner gives) and the LM
head are transformers' own modules; attention is batchgen's: every attention
layer calls the registered function (``registered_attention.py``), which writes K/V into
the paged cache and runs the paged kernels over the step's flat token batch,
exactly as the native models do. The scheduler, prefix cache, preemption,
sampling, structured output and logprobs around it are the engine's, unchanged.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.kernels.batch import AttentionBatch, AttentionKind, StepAttention
from batchgen.kernels.ops import KernelOps
from batchgen.worker.models.hf_backend.probe import LayerPlan, probe_layout
from batchgen.worker.models.hf_backend.qualify import (
    LayerKinds,
    causal_lm_class,
    check_config,
    check_release,
    context_limit,
    layer_kinds,
)
from batchgen.worker.models.hf_backend.recurrent import (
    SEGMENTS,
    SequenceStates,
    keep_state_per_sequence,
)
from batchgen.worker.models.hf_backend.registered_attention import (
    ACTIVE,
    ATTN_IMPLEMENTATION,
    register,
)
from batchgen.worker.models.loader import checkpoint_files
from batchgen.worker.models.model_config import release_window
from batchgen.worker.worker_errors import UnsupportedModelError


@dataclass(frozen=True, slots=True)
class BackendConfig:
    """What the engine reads of a model: sizes, and the KV cache's shape."""

    architecture: str  # the transformers class, e.g. "GPTNeoXForCausalLM"
    vocab_size: int  # the width of the logits
    hidden_size: int
    num_layers: int  # attention layers, each one KV cache layer
    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # each layer's sliding window; None: full attention
    keeps_state: bool  # recurrent layers keep a state per sequence (recurrent.py)
    kv_shared: bool = False  # K and V in one tensor: only native MLA does that

    @property
    def release_window(self) -> int | None:
        # a stateful model's sequences are known by their first block: it must stay theirs
        return None if self.keeps_state else release_window(self.windows)


class _Step:
    """The attention sink of one forward: the step's batch and KV cache."""

    def __init__(
        self,
        layers: dict[torch.nn.Module, LayerPlan],
        ops: KernelOps,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.layers, self.ops, self.batch, self.kv_caches = layers, ops, batch, kv_caches
        self.planned: dict[AttentionKind, StepAttention] = {}  # once per step per kind

    def attend(self, module, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        layer = self.layers[module]
        k_cache, v_cache = self.kv_caches[layer.index]
        attention = self.planned.get(layer.kind)
        if attention is None:
            attention = self.ops.attention(self.batch, k_cache, v_cache, layer.kind)
            self.planned[layer.kind] = attention
        # (1, heads, T, D) -> (T, heads, D), the kernels' flat layout
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        return attention(q, k, v, k_cache, v_cache).unsqueeze(0)


class _PassHidden(torch.nn.Module):
    """Stands in for the base model inside the LM-head copy: returns what it is given.
    Any part of the base model the head's forward calls (OPT calls ``model.decoder``)
    is this pass-through too."""

    def forward(self, *_: Any, inputs_embeds: torch.Tensor, **__: Any) -> Any:
        return _hidden_only_class()(last_hidden_state=inputs_embeds)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):
                raise
            return self


@functools.cache
def _hidden_only_class() -> type:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class HiddenOnly(BaseModelOutputWithPast):
        """A base model's output with only the hidden states: every other field
        a head may read (cross_attentions, router_logits...) is None."""

        def __getattr__(self, name: str) -> Any:
            if name.startswith("_"):
                raise AttributeError(name)
            return None

    return HiddenOnly


class HfCausalLM:
    """The engine's model interface (``forward``, ``compute_logits``, ``config``) over transformers."""

    def __init__(self, hf: Any, layers: dict[torch.nn.Module, LayerPlan], ops: KernelOps,
                 config: BackendConfig, states: SequenceStates | None) -> None:  # fmt: skip
        self.hf = hf
        self.base = hf.base_model
        self.layers = layers
        self.ops = ops
        self.config = config
        self.states = states
        # The model's own forward after its base model: lm_head and whatever the
        # class does to the logits (soft-capping, logit scales), on hidden states we give.
        self.head = copy.copy(hf)
        self.head._modules = dict(hf._modules)
        self.head._modules[hf.base_model_prefix] = _PassHidden()

    @classmethod
    def load(
        cls,
        path: Path,
        hf_config: Any,
        ops: KernelOps,
        device: torch.device,
        dtype: torch.dtype,
    ) -> HfCausalLM:
        """Builds the model from ``path``'s safetensors, refusing what it cannot run exactly."""
        kinds, _ = cls.check_config(hf_config)
        windows = kinds.windows
        model_class = causal_lm_class(hf_config)
        name = model_class.__name__
        checkpoint_files(path)  # safetensors only, every shard present
        register()
        try:
            hf, info = model_class.from_pretrained(
                str(path), config=hf_config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION,
                local_files_only=True, use_safetensors=True, output_loading_info=True,
            )  # fmt: skip
        except (KeyError, ValueError, TypeError, AttributeError, OSError) as exc:
            why = f"{type(exc).__name__}: {exc}"
            if ATTN_IMPLEMENTATION in str(exc):
                why = "its attention does not go through transformers' attention registry"
            raise UnsupportedModelError(
                f"transformers cannot build {name} with batchgen's attention ({why})"
            ) from exc
        _check_loading(name, path, info)
        hf.to(device).eval()
        states = None
        if kinds.recurrent:
            if keep_state_per_sequence(hf.base_model) != len(kinds.recurrent):
                raise UnsupportedModelError(
                    f"{name}'s linear-attention layers are not the gated DeltaNet modules whose "
                    "per-sequence state batchgen keeps"
                )
            states = SequenceStates(hf_config)
        layout = probe_layout(hf.base_model, len(windows), windows, device)
        lm_head = hf.get_output_embeddings()
        if lm_head is None:
            raise UnsupportedModelError(f"{name} has no output embeddings (LM head)")
        config = BackendConfig(
            architecture=name, vocab_size=int(lm_head.weight.shape[0]),
            hidden_size=layout.hidden_size, num_layers=len(windows),
            num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim, windows=tuple(windows),
            keeps_state=states is not None,
        )  # fmt: skip
        model = cls(hf, layout.layers, ops, config, states)
        return model

    @staticmethod
    def check_config(hf_config: Any) -> tuple[LayerKinds, int | None]:
        """Refuses, naming the architecture, what the config alone shows cannot run here
        (before any weight is read). Returns which layers attend (with their windows) and
        which keep a recurrent state, and the longest context that runs exactly (None: the
        config gives none)."""
        import transformers

        check_release(transformers.__version__)
        name = causal_lm_class(hf_config).__name__
        kinds = layer_kinds(hf_config, name)
        check_config(hf_config, name)
        return kinds, context_limit(hf_config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids, positions (num_tokens,) -> final hidden states (num_tokens, hidden)."""
        token = ACTIVE.set(_Step(self.layers, self.ops, batch, kv_caches))
        segments = SEGMENTS.set(self.states.segments(batch) if self.states else None)
        try:
            out = self.base(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            )
        finally:
            SEGMENTS.reset(segments)
            ACTIVE.reset(token)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(num_rows, hidden) -> (num_rows, vocab) fp32, as the model's own head computes them."""
        return self.head(inputs_embeds=hidden[None], use_cache=False).logits[0].float()


def _check_loading(name: str, path: Path, info: dict[str, Any]) -> None:
    """Every tensor the model has came from the checkpoint, and every tensor there was read."""
    problems = []
    if info.get("missing_keys"):
        problems.append(f"lacks {_few(info['missing_keys'])}")
    if info.get("unexpected_keys"):
        problems.append(f"holds tensors {name} never reads: {_few(info['unexpected_keys'])}")
    if info.get("mismatched_keys"):
        problems.append(f"has wrongly shaped {_few(k[0] for k in info['mismatched_keys'])}")
    if info.get("error_msgs"):
        problems.append("; ".join(info["error_msgs"]))
    if problems:
        raise UnsupportedModelError(f"checkpoint {path} {'; '.join(problems)}")


def _few(names: Any) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")
