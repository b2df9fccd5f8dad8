"""What the model code needs from an HF config, read once through transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.jobs.schema.errors import BatchgenError

# HF architecture name -> the features our one Llama-family model turns on.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


class UnsupportedModelError(BatchgenError, ValueError):
    """The checkpoint is not one batchgen can run (architecture, file or feature); the CLI
    reports it in one line."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_parameters: dict[str, Any]
    sliding_window: int | None
    torch_dtype: str | None
    hf_config: Any  # the transformers config object, for rope init


def read_hf_config(path: str | Path) -> Any:
    """config.json as transformers reads it (its config object)."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise UnsupportedModelError(f"{path} has no config.json: not a checkpoint directory")
    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"cannot read {path / 'config.json'}: {exc}") from exc


def is_native(hf: Any) -> bool:
    """Whether one of the checkpoint's architectures is a family batchgen has its own code for."""
    return any(a in SUPPORTED_ARCHITECTURES for a in getattr(hf, "architectures", None) or [])


def load_model_config(path: str | Path, hf: Any = None) -> ModelConfig:
    """Reads config.json with transformers (unless given) and checks we support what it asks for."""
    path = Path(path)
    if hf is None:
        hf = read_hf_config(path)
    archs = list(getattr(hf, "architectures", None) or [])
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise UnsupportedModelError(
            f"architecture {', '.join(archs) or '(none given)'} in {path} is not supported; "
            f"batchgen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[supported[0]]
    hidden_act = getattr(hf, "hidden_act", "silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported (only silu)")
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "dynamic":
        raise UnsupportedModelError("dynamic NTK rope scaling is not supported")
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    window = getattr(hf, "sliding_window", None)
    if family in ("qwen2", "qwen3") and not getattr(hf, "use_sliding_window", False):
        window = None
    return ModelConfig(
        architecture=family,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias; Llama/Mistral/Qwen3 say so in the config.
        attention_bias=family == "qwen2" or bool(getattr(hf, "attention_bias", False)),
        qk_norm=family == "qwen3",
        rope_parameters=rope,
        sliding_window=window,
        torch_dtype=checkpoint_dtype(hf),
        hf_config=hf,
    )


def checkpoint_dtype(hf: Any) -> str | None:
    """The dtype the checkpoint was saved in ("bfloat16", ...), when its config says."""
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None
