"""gpt-oss MXFP4 checkpoints, written offline in the layout OpenAI's gpt-oss-20b/120b ship.

``quantize_mxfp4(src, out)`` turns a plain gpt-oss checkpoint (the zoo's) into a
``quant_method: mxfp4`` one: each layer's ``mlp.experts.gate_up_proj`` (E, hidden,
2 * inter) and ``down_proj`` (E, inter, hidden), transformers' input-major
parameters, become ``*_blocks`` uint8 (E, N, K/32, 16) and ``*_scales`` uint8
(E, N, K/32) over their output-major transpose (N out, K in), as transformers'
``Mxfp4ReverseDeserialize`` writes them and its dequantizer reads them back. By
the format's definition (the OCP MX spec): a group of 32 inputs shares the
scale 2^s with s = ceil(log2(amax / 6)), stored as s + 127, so every scaled
value is within e2m1's +-6; each value becomes the nearest e2m1 code (sign in
bit 3), two a byte, the lower-indexed input in the low nibble. Biases,
attention, router, norms, embeddings and lm_head stay as they are, and the
config gets the releases' ``quantization_config``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# gpt-oss-20b's and -120b's config.json
RELEASE_NOT_CONVERTED = [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
]  # fmt: skip


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) float -> (blocks uint8 (..., N, K/32, 16), scales uint8 (..., N, K/32))."""
    groups = weight.float().reshape(*weight.shape[:-1], weight.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(-1)
    codes |= (scaled < 0).long() << 3
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    return (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8), (exponent + 127).to(torch.uint8)


def quantize_mxfp4(src: Path, out: Path, skip: tuple[str, ...] = ()) -> Path:
    """``skip``: experts modules (``model.layers.1.mlp.experts``) left plain, added to
    modules_to_not_convert."""
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        module, _, param = name.rpartition(".")
        if param in ("gate_up_proj", "down_proj") and module not in skip:
            blocks, scales = mxfp4(tensor.transpose(1, 2))
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = tensor
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": RELEASE_NOT_CONVERTED + list(skip),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
