"""compressed-tensors MoE checkpoints written by the compressed-tensors library itself.

transformers 5 holds a Qwen3-MoE layer's experts fused (``Qwen3MoeExperts``:
``gate_up_proj`` (E, 2 * inter, hidden), no ``nn.Linear`` per expert), so the
library cannot quantize them through a transformers model as ``compress``
(``tests/quant_checkpoints.py``) does for dense ones. The hub releases
(RedHatAI's W4A16 MoE, llm-compressor's output) store each expert's projections
separately, as the plain checkpoint names them:
``model.layers.N.mlp.experts.E.gate_proj.weight_packed``, ``.weight_scale``,
``.weight_shape``. ``compress_moe`` writes that layout: every 2-D projection of
the plain checkpoint (attention, dense MLP, each expert's gate/up/down, the
router ``mlp.gate``, ``lm_head``) becomes an ``nn.Linear`` at its checkpoint
name, and the library applies the scheme (its ``ignore`` list included),
computes each group's scale from its min/max (``calculate_qparams``), packs
(``ModelCompressor.compress_model``) and writes the config
(``update_config``).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.quant_checkpoints import CT_SCHEMES, _rewrite, ct_quantize

LINEAR = re.compile(
    r"(lm_head|model\.layers\.\d+\.(self_attn|mlp|block_sparse_moe)\.(experts\.\d+\.)?\w+)\.weight$"
)
SCHEMES: dict[str, dict[str, Any]] = {
    **CT_SCHEMES,
    "w8a16": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                  format="pack-quantized"),
}  # fmt: skip


def _module_tree(tensors: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """An ``nn.Linear`` at each projection's checkpoint name; the other tensors aside."""
    root, rest = torch.nn.Module(), {}
    for name, tensor in tensors.items():
        match = LINEAR.match(name)
        if match is None or tensor.dim() != 2:
            rest[name] = tensor
            continue
        *path, leaf = match.group(1).split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        linear = torch.nn.Linear(tensor.shape[1], tensor.shape[0], bias=False)
        linear.weight.data = tensor.clone()
        parent.add_module(leaf, linear)
    return root, rest


def compress_moe(src: Path, out: Path, scheme: str, ignore: tuple[str, ...]) -> Path:
    """The plain MoE checkpoint ``src`` quantized by the compressed-tensors library in the
    releases' per-expert layout (``ct_quantize``); ``ignore`` as llm-compressor's recipes
    write it."""
    root, rest = _module_tree(load_file(str(src / "model.safetensors")))
    compressor = ct_quantize(root, SCHEMES[scheme], ignore)
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, out / file.name)
    tensors = {**rest, **root.state_dict()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    compressor.update_config(str(out))
    return out


def moe_reference(path: Path) -> Any:
    """transformers in fp32 on a compressed-tensors MoE checkpoint, every weight decompressed
    as it loads (``CompressedTensorsConfig(dequantize=True)``: the experts' per-expert
    tensors decompressed by the library, then fused as transformers holds them)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=CompressedTensorsConfig(dequantize=True),
    )  # fmt: skip
    return model.eval()


def ct_dequantized(src: Path, out: Path) -> Path:
    """The pack-quantized 4-bit checkpoint ``src`` as plain fp32, by the format's definition in
    plain torch (``kernels/quant_reference.py``'s ``dequantize_pack_quantized``: each group's
    ``(q - zero_point) * scale``): the reference where transformers cannot decompress it
    (asymmetric experts: its MoE decompression drops the zero points and refuses)."""
    from batchgen.kernels.quant_reference import dequantize_pack_quantized

    tensors = load_file(str(src / "model.safetensors"))

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        module, _, field = name.rpartition(".")
        if field == "weight_packed":
            zero_point = tensors.get(f"{module}.weight_zero_point")
            weight = dequantize_pack_quantized(
                tensor, tensors[f"{module}.weight_scale"], zero_point
            )
            return {f"{module}.weight": weight.t().contiguous()}
        if field in ("weight_scale", "weight_zero_point", "weight_shape"):
            return {}
        return {name: tensor}

    return _rewrite(src, out, convert, None)
