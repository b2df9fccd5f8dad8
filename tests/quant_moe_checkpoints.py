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

import json
import re
import shutil
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from tests.quant_checkpoints import CT_SCHEMES

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
    releases' per-expert layout; ``ignore`` as llm-compressor's recipes write it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    spec = SCHEMES[scheme]
    weights = QuantizationArgs(**spec["weights"])
    acts = spec.get("input_activations")
    group = QuantizationScheme(
        targets=["Linear"], weights=weights,
        input_activations=None if acts is None else QuantizationArgs(**acts),
    )  # fmt: skip
    root, rest = _module_tree(load_file(str(src / "model.safetensors")))
    config = QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore))
    apply_quantization_config(root, config)
    with torch.no_grad():
        for module in root.modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            module = cast(Any, module)  # a Linear with the scheme's parameters added
            w = module.weight
            if weights.group_size is not None:
                w = w.unflatten(-1, (-1, weights.group_size))
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(root, quantization_format=spec["format"])
    compressor.compress_model(root)
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
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, _, field = name.rpartition(".")
        if field == "weight_packed":
            zero_point = tensors.get(f"{module}.weight_zero_point")
            weight = dequantize_pack_quantized(
                tensor, tensors[f"{module}.weight_scale"], zero_point
            )
            plain[f"{module}.weight"] = weight.t().contiguous()
        elif field not in ("weight_scale", "weight_zero_point", "weight_shape"):
            plain[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(plain, str(out / "model.safetensors"))
    return out
