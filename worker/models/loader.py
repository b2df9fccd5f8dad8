"""Reads HF safetensors checkpoints (single file or sharded) into our weight layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from batchgen.worker.models.model_config import ModelConfig, UnsupportedModelError
from batchgen.worker.models.weights import LayerWeights, ModelWeights


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UnsupportedModelError(
                f"{path} is missing shard(s) named in its index: {', '.join(missing)}"
            )
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise UnsupportedModelError(
            f"{path} holds PyTorch .bin weights; batchgen reads only safetensors "
            "(convert with transformers: model.save_pretrained(dir))"
        )
    raise UnsupportedModelError(f"{path} has no model.safetensors or model.safetensors.index.json")


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def load_weights(
    path: str | Path, config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> ModelWeights:
    """Loads every tensor the model needs, fusing q/k/v and gate/up into one matrix each
    and storing projections input-major (see ``weights.py``)."""
    raw = _read_tensors(checkpoint_files(Path(path)))

    def take(name: str) -> torch.Tensor:
        tensor = raw.pop(name, None)
        if tensor is None:
            raise UnsupportedModelError(f"checkpoint {path} lacks tensor {name!r}")
        return tensor.to(device=device, dtype=dtype)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv = torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"])
        bias = None
        if config.attention_bias:
            bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv.t().contiguous(),
                qkv_bias=bias,
                q_norm=take(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=take(attn + "k_norm.weight") if config.qk_norm else None,
                o_proj=take(attn + "o_proj.weight").t().contiguous(),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat(
                    [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                )
                .t()
                .contiguous(),
                down=take(p + "mlp.down_proj.weight").t().contiguous(),
            )
        )
    embed = take("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in raw:
        # a copy is worth its memory on the CPU; CUDA's matmuls take the transposed view as fast
        lm_head = embed.t().contiguous() if device.type == "cpu" else embed.t()
    else:
        lm_head = take("lm_head.weight").t().contiguous()
    return ModelWeights(
        embed=embed, layers=layers, final_norm=take("model.norm.weight"), lm_head=lm_head
    )
