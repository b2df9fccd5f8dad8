"""Quantized tiny checkpoints, written offline in the exact on-disk layout of the hub releases.

``quantize_fp8_block(src, out, block)`` turns a plain fp32 checkpoint (a zoo
model) into a ``quant_method: fp8`` one as DeepSeek-V3 and Qwen3-FP8 ship it:
every decoder projection becomes ``NAME.weight`` float8_e4m3fn (out, in) and
``NAME.weight_scale_inv`` fp32 over (ceil(out / bn), ceil(in / bk)) blocks
(amax / 448 per block, as the releases' quantizer computes it), embeddings,
norms and lm_head stay as they are. ``dequantized(src, out)`` writes the same
checkpoint back as plain fp32 by the format's definition (fp8 * scale of its
block), the reference transformers runs where it cannot dequantize itself.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
# the projections transformers replaces (every nn.Linear of a layer)
PROJECTION = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")


def _rewrite(
    src: Path, out: Path, convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]],
    quantization_config: dict[str, Any] | None,
) -> Path:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        tensors.update(convert(name, tensor))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) fp32 -> (fp8 (N, K), fp32 scale_inv (ceil(N/bn), ceil(K/bk)))."""
    bn, bk = block
    n, k = weight.shape
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    padded = torch.zeros(grid[0] * bn, grid[1] * bk)
    padded[:n, :k] = weight
    blocks = padded.view(grid[0], bn, grid[1], bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(grid[0] * bn, grid[1] * bk)[:n, :k].contiguous(), scale


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return q.float() * full


def quantize_fp8_block(
    src: Path, out: Path, block: tuple[int, int], skip: tuple[str, ...] = ()
) -> Path:
    """``skip``: modules left plain, written to modules_to_not_convert."""

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        module = name.removesuffix(".weight")
        if not PROJECTION.match(name) or any(module.endswith(s) for s in skip):
            return {name: tensor}
        q, scale = fp8_block(tensor.float(), block)
        return {name: q, f"{module}.weight_scale_inv": scale}

    config: dict[str, Any] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
        "weight_block_size": list(block),
    }  # fmt: skip
    if skip:
        config["modules_to_not_convert"] = list(skip)
    return _rewrite(src, out, convert, config)


def dequantized(src: Path, out: Path) -> Path:
    """The quantized checkpoint ``src`` as plain fp32, by its format's definition."""
    config = json.loads((src / "config.json").read_text())["quantization_config"]
    block = tuple(config["weight_block_size"])
    tensors = load_file(str(src / "model.safetensors"))

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if name.endswith(".weight_scale_inv"):
            return {}
        scale = tensors.get(name.removesuffix(".weight") + ".weight_scale_inv")
        return {name: tensor if scale is None else fp8_dequantize(tensor, scale, block)}

    return _rewrite(src, out, convert, None)
