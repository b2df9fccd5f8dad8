"""Reading the switches most families share: sizes, rotary, per-layer windows, activation.

Each function reads through a ``ConfigReader`` (so what it reads is
accounted for) and refuses, by name, a value the decoder cannot honour.
"""

from __future__ import annotations

from typing import Any

from batchgen.worker.models.config_keys import ConfigReader
from batchgen.worker.models.layers.mlp import ACTIVATIONS
from batchgen.worker.models.model_config import RopeSpec
from batchgen.worker.worker_errors import UnsupportedModelError

# rope_type values whose tables ``rope.py`` computes as transformers does
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


def head_dim(r: ConfigReader, hidden_size: int, num_heads: int) -> int:
    return int(r.get("head_dim") or hidden_size // num_heads)


def activation(r: ConfigReader, key: str = "hidden_act") -> str:
    name = r.require(key)
    if name not in ACTIVATIONS:
        raise r.refuse(key, f"known activations: {', '.join(ACTIVATIONS)}")
    return str(name)


def _rope_spec(r: ConfigReader, params: dict[str, Any], layer_type: str | None) -> RopeSpec:
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    if params["rope_type"] not in ROPE_TYPES:
        raise r.refuse("rope_parameters", f"rope types: {', '.join(ROPE_TYPES)}")
    # lists (longrope's factors) as tuples: the spec is hashable
    items = ((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())
    return RopeSpec(tuple(sorted(items)), layer_type)


def ropes(r: ConfigReader, head_dim: int) -> tuple[tuple[RopeSpec, ...], dict[str, int], int]:
    """The model's rotary tables, which table each layer type uses, and the rotary dim.

    rope_parameters is one dict, or (Gemma 3, OLMo 3) one per layer type;
    partial_rotary_factor in it rotates only the leading channels of a head.
    """
    params = r.require("rope_parameters")
    if all(isinstance(v, dict) for v in params.values()):
        by_type = {t: _rope_spec(r, p, t) for t, p in params.items()}
    else:
        by_type = {"*": _rope_spec(r, params, None)}
    specs = tuple(dict.fromkeys(by_type.values()))
    factors = {float(s.get("partial_rotary_factor", 1.0)) for s in specs}
    if len(factors) != 1:
        raise r.refuse("rope_parameters", "one partial_rotary_factor for every layer type")
    rotary_dim = int(head_dim * factors.pop())
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise r.refuse("rope_parameters", f"rotary dim {rotary_dim} of head_dim {head_dim}")
    return specs, {t: specs.index(s) for t, s in by_type.items()}, rotary_dim


def rope_of(table_of: dict[str, int], layer_type: str) -> int:
    return table_of.get(layer_type, table_of.get("*", 0))


def context_length(r: ConfigReader, specs: tuple[RopeSpec, ...]) -> int:
    """max_position_embeddings, or less where rotary is exact only for shorter sequences.

    longrope switches every position to its long factors once a sequence passes
    original_max_position_embeddings, and transformers then rotates the new
    tokens differently from the cached ones: no per-token table matches that,
    so the context stops where the short factors end. (Dynamic NTK changes
    nothing up to max_position_embeddings.)
    """
    limit = int(r.require("max_position_embeddings"))
    for spec in specs:
        if spec.rope_type == "longrope":
            limit = min(limit, int(spec.get("original_max_position_embeddings") or limit))
    return limit


def layer_types(r: ConfigReader, num_layers: int) -> list[str]:
    """Each layer's type; every layer full attention where the config names none."""
    types = list(r.get("layer_types") or ["full_attention"] * num_layers)
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise r.refuse("layer_types", f"{num_layers} of {', '.join(LAYER_TYPES)}")
    return types


def windows(r: ConfigReader, types: list[str], every_layer: bool = False) -> list[int | None]:
    """Each layer's sliding window: sliding_window on the layers typed sliding_attention
    (or on every layer, for families whose transformers code applies it to all)."""
    window = r.get("sliding_window")
    if not every_layer and "sliding_attention" not in types:
        return [None] * len(types)  # no layer slides: the value is not used (Qwen2-MoE sets 0)
    if window is not None and (not isinstance(window, int) or window < 1):
        raise r.refuse("sliding_window", "a positive number of tokens")
    if every_layer:
        return [window] * len(types)
    return [window if t == "sliding_attention" else None for t in types]


def refuse_if_set(r: ConfigReader, key: str, why: str, off: Any = False) -> None:
    """A switch the family honours only in its off state."""
    value = r.get(key, off)
    if value != off:
        raise r.refuse(key, why)


def positive_int(r: ConfigReader, key: str) -> int:
    value = r.require(key)
    if not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"config {key} must be a positive integer, got {value!r}")
    return value


def dtype_name(r: ConfigReader) -> str | None:
    """The checkpoint's dtype as config.json names it (dtype, or torch_dtype before v5)."""
    dtype = r.get("dtype") or r.get("torch_dtype")
    return None if dtype is None else str(dtype).removeprefix("torch.")
