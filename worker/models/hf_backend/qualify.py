"""Whether a checkpoint's config can run through the transformers backend, read before any weight.

Everything here is a refusal with its reason, named after the architecture:
what the config alone shows batchgen's paged attention cannot do. What only
running the model shows (a layer that never calls the registry, an argument
the kernels do not honour) is the probe's (``probe.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from batchgen.worker.worker_errors import UnsupportedModelError

# The oldest transformers release the backend runs on: its parity tests pass on 5.24
# and later. It reads each layer's kind and window as transformers describes them from
# 5.24 (on 5.17 it found no layer at all), and the hybrids' mixers take each sequence's
# state as ``cache`` from 5.24 (recurrent.py).
BACKEND_RELEASE = (5, 24)

# What a layer type (transformers' ``layer_types``) would need that batchgen does not have.
_RECURRENT = (
    "keeps a recurrent state per sequence (linear attention, state-space or convolution "
    "layers), which batchgen keeps only for Qwen3-Next's and Qwen3.5's gated DeltaNet layers; "
    "running it would take a per-sequence state of its own beside the KV blocks, carried from "
    "step to step and recomputed after preemption and hand-back"
)
# model types whose linear_attention layers are gated DeltaNet modules recurrent.py runs
_DELTANET_HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
_LAYER_TYPE_REASONS = {
    "linear_attention": _RECURRENT,
    "conv": _RECURRENT,
    "hybrid": _RECURRENT,
    "hybrid_sliding": _RECURRENT,
    "chunked_attention": "attends within fixed chunks (attention_chunk_size); batchgen's "
    "kernels attend causally, within a sliding window at most",
    "dummy": "has layers that reuse another layer's KV cache or have no attention",
}
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# rope types whose frequencies transformers picks per forward from the longest
# sequence in the batch once past ``original_max_position_embeddings``
_BATCH_DEPENDENT_ROPE = ("longrope",)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: ``5.26.0.dev0`` -> (5, 26)."""
    major, minor = (int(n) for n in re.findall(r"\d+", version)[:2])
    return major, minor


def check_release(version: str) -> None:
    """Refuses a transformers release older than the backend runs on, naming both."""
    if release(version) < BACKEND_RELEASE:
        needed = ".".join(map(str, BACKEND_RELEASE))
        raise UnsupportedModelError(
            f"batchgen's transformers backend needs transformers {needed} or later, and "
            f"{version} is installed (pip install 'transformers>={needed}')"
        )


def causal_lm_class(hf_config: Any) -> Any:
    """The ``*ForCausalLM`` class transformers builds for this config, or a refusal."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    archs = list(getattr(hf_config, "architectures", None) or [])
    named = ", ".join(archs) or f"model_type {hf_config.model_type!r}"
    if getattr(hf_config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{named} is an encoder-decoder model; batchgen runs decoder-only causal LMs"
        )
    if getattr(hf_config, "auto_map", None):
        raise UnsupportedModelError(
            f"{named} needs its own code from the checkpoint (auto_map, trust_remote_code); "
            "batchgen runs only transformers' own model classes"
        )
    try:
        cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise UnsupportedModelError(
            f"{named} is not a causal LM transformers can build (no AutoModelForCausalLM "
            f"class for model_type {hf_config.model_type!r})"
        ) from None
    if archs and cls.__name__ not in archs:
        raise UnsupportedModelError(
            f"{named} is not the causal LM transformers builds for model_type "
            f"{hf_config.model_type!r} ({cls.__name__})"
        )
    return cls


@dataclass(frozen=True, slots=True)
class LayerKinds:
    windows: list[int | None]  # each attention layer's sliding window (None: full), in order
    recurrent: list[int]  # the layers that keep a recurrent state instead (gated DeltaNet)


def layer_kinds(hf_config: Any, name: str) -> LayerKinds:
    """Which layers attend (and with which window) and which keep a recurrent state,
    as transformers reads the config; a refusal for any other kind of layer."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(hf_config)
    runs: tuple[str, ...] = _ATTENTION_LAYER_TYPES
    if hf_config.model_type in _DELTANET_HYBRIDS:
        runs = (*runs, "linear_attention")
    for kind in dict.fromkeys(types):
        if kind not in runs:
            layers = [i for i, t in enumerate(types) if t == kind]
            reason = _LAYER_TYPE_REASONS.get(kind, "is a kind of layer batchgen cannot run")
            raise UnsupportedModelError(
                f"{name} cannot run: its layers {_span(layers)} are {kind!r}; this model {reason}"
            )
    windows = [kw.get("sliding_window") if t == "sliding_attention" else None
               for t, kw in zip(types, kwargs) if t in _ATTENTION_LAYER_TYPES]  # fmt: skip
    return LayerKinds(windows, [i for i, t in enumerate(types) if t == "linear_attention"])


def check_config(hf_config: Any, name: str) -> None:
    """The switches outside the model's own modules that batchgen would have to honour."""
    if getattr(hf_config, "add_cross_attention", False):
        raise UnsupportedModelError(f"{name} has cross-attention layers (add_cross_attention)")
    if getattr(hf_config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"{name} attends bidirectionally (use_bidirectional_attention); batchgen attends causally"
        )
    if getattr(hf_config, "quantization_config", None):
        raise UnsupportedModelError(f"{name} is a quantized checkpoint (quantization_config)")
    if getattr(hf_config, "alibi", False):
        raise UnsupportedModelError(
            f"{name} adds ALiBi position biases to its attention scores (alibi); batchgen's "
            "paged kernels do not compute them"
        )


def context_limit(hf_config: Any) -> int | None:
    """max_position_embeddings, or less where transformers' rotary is exact only for
    shorter sequences: longrope switches every position to its long factors once the
    longest sequence of the batch passes original_max_position_embeddings, which no
    per-sequence computation reproduces. None: the config gives no limit."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    for rope in _rope_parameter_sets(hf_config):
        original = rope.get("original_max_position_embeddings")
        if rope.get("rope_type", rope.get("type")) in _BATCH_DEPENDENT_ROPE and original:
            limit = min(limit or original, int(original))
    return limit


def _rope_parameter_sets(hf_config: Any) -> list[dict[str, Any]]:
    """rope_parameters is one dict, or one per layer type (Gemma 3)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return list(rope.values())
    return [rope]


def _span(layers: list[int]) -> str:
    shown = ", ".join(map(str, layers[:6]))
    return shown + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
