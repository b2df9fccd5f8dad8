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
from typing import Any, cast

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
    src: Path, out: Path, block: tuple[int, int], skip: tuple[str, ...] = (),
    projections: re.Pattern[str] = PROJECTION,
) -> Path:  # fmt: skip
    """``skip``: modules left plain, written to modules_to_not_convert; ``projections``: the
    weights quantized (an MoE family's experts and MLA's projections have other names)."""

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        module = name.removesuffix(".weight")
        if not projections.match(name) or any(module.endswith(s) for s in skip):
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


# compressed-tensors schemes as llm-compressor's presets write them
CT_SCHEMES: dict[str, dict[str, Any]] = {
    "w4a16": dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=32), format="pack-quantized"),
    "w4a16-g128": dict(weights=dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                    group_size=128), format="pack-quantized"),
    "w4a16-asym": dict(weights=dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                    group_size=16), format="pack-quantized"),
    "w8a8-int8": dict(weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                      input_activations=dict(num_bits=8, type="int", symmetric=True,
                                             strategy="token", dynamic=True),
                      format="int-quantized"),
    "fp8-dynamic": dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                        input_activations=dict(num_bits=8, type="float", symmetric=True,
                                               strategy="token", dynamic=True),
                        format="float-quantized"),
    # static per-tensor FP8 input scales (llm-compressor's FP8 preset), weights per tensor
    # or per channel
    **{name: dict(weights=dict(num_bits=8, type="float", symmetric=True, strategy=strategy),
                  input_activations=dict(num_bits=8, type="float", symmetric=True,
                                         strategy="tensor", dynamic=False),
                  format="float-quantized")
       for name, strategy in (("fp8-static", "tensor"), ("fp8-static-channel", "channel"))},
}  # fmt: skip


def _input_ranges(model: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each projection's input min and max over a short calibration prompt (what a static
    scale is calibrated from; longer prompts then go past it and clamp)."""
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> None:
            seen[name] = (inputs[0].amin().reshape(1), inputs[0].amax().reshape(1))

        return record

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(hook(name))
    with torch.no_grad():
        model(torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(3)))
    return seen


def ct_quantize(
    model: torch.nn.Module, spec: dict[str, Any], ignore: tuple[str, ...],
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Any:  # fmt: skip
    """``model``'s Linears quantized in place by the compressed-tensors library as ``spec`` (a
    CT_SCHEMES entry) says, but those ``ignore`` names: its scales from each channel's or
    group's min/max (``calculate_qparams``), a static input scale from the calibration
    ranges ``seen``, then its compressor; that compressor (its ``update_config`` writes
    the config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    weights = QuantizationArgs(**spec["weights"])
    acts = spec.get("input_activations")
    group = QuantizationScheme(
        targets=["Linear"], weights=weights,
        input_activations=None if acts is None else QuantizationArgs(**acts),
    )  # fmt: skip
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": group}, ignore=list(ignore))
    )
    seen = seen or {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            module = cast(Any, module)  # a Linear with the scheme's parameters added
            w = module.weight
            if weights.group_size is not None:
                w = w.unflatten(-1, (-1, weights.group_size))
            if weights.strategy == "tensor":
                w = w.reshape(1, -1)
            scale, zero_point = calculate_qparams(w.amin(-1), w.amax(-1), weights)
            if name in seen:  # static input scale: the calibration inputs' min/max
                lo, hi = seen[name]
                module.input_scale.copy_(calculate_qparams(lo, hi, group.input_activations)[0])
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=spec["format"])
    compressor.compress_model(model)
    return compressor


def compress(src: Path, out: Path, scheme: str, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
    """``src`` quantized and saved by the compressed-tensors library itself (``ct_quantize``):
    its scales, its compressor, its config."""
    from transformers import AutoModelForCausalLM

    spec = CT_SCHEMES[scheme]
    acts = spec.get("input_activations")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    seen = _input_ranges(model) if acts is not None and not acts["dynamic"] else {}
    compressor = ct_quantize(model, spec, ignore, seen)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    return out


def compressed_reference(path: Path) -> Any:
    """transformers' model of a compressed-tensors checkpoint, its weights decompressed
    (``CompressedTensorsConfig(run_compressed=False)``), with each quantized projection's
    input quantized dynamically by compressed-tensors' own functions, as its quantized
    forward does (transformers' decompressed model drops that step)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=CompressedTensorsConfig(run_compressed=False),
    )  # fmt: skip
    model.eval()
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    if group.get("input_activations") is not None:
        args = QuantizationArgs(**group["input_activations"])

        def quantize_input(module: torch.nn.Module, inputs: tuple[torch.Tensor]) -> tuple:
            scale, zero_point = compute_dynamic_scales_and_zp(inputs[0], args, module)
            return (fake_quantize(inputs[0], scale, zero_point, args),)

        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name not in config["ignore"]:
                module.register_forward_pre_hook(quantize_input)
    return model


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(K, N) unsigned -> (K * bits / 32, N) int32: rows low bits first (GPTQ's qweight)."""
    per = 32 // bits
    q = q.to(torch.int32).view(q.shape[0] // per, per, q.shape[1])
    word = torch.zeros(q.shape[0], q.shape[2], dtype=torch.int32)
    for j in range(per):
        word |= q[:, j] << (bits * j)
    return word


def _pack_columns(q: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """(R, N) unsigned -> (R, N * bits / 32) int32; field i of a word holds column order[i]."""
    per = 32 // bits
    q = q.to(torch.int32).view(q.shape[0], -1, per)
    word = torch.zeros(q.shape[0], q.shape[1], dtype=torch.int32)
    for i, column in enumerate(order or range(per)):
        word |= q[..., column] << (bits * i)
    return word


def _int_groups(
    weight: torch.Tensor, group_of: torch.Tensor, groups: int, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) fp32 -> q (K, N) unsigned, zeros (groups, N), fp16 scales (groups, N), from
    each group's min/max (what GPTQ/AWQ's packers store; their rounding search is theirs)."""
    maxq = (1 << bits) - 1
    n = weight.shape[0]
    scales, zeros = torch.zeros(groups, n), torch.zeros(groups, n, dtype=torch.int32)
    for g in range(groups):
        cols = weight[:, group_of == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if symmetric:
            scale = torch.maximum(lo.abs(), hi).clamp(min=1e-8) * 2 / maxq
            zero = torch.full((n,), (maxq + 1) // 2, dtype=torch.int32)
        else:
            scale = ((hi - lo) / maxq).clamp(min=1e-8)
            zero = torch.round(-lo / scale).clamp(1, maxq).to(torch.int32)
        scales[g], zeros[g] = scale.half().float(), zero
    per_k = scales[group_of].t(), zeros[group_of].t()  # (N, K)
    q = torch.clamp(torch.round(weight / per_k[0]) + per_k[1], 0, maxq).to(torch.int32)
    return q.t().contiguous(), zeros, scales.half()


def _int_dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(K, N) values with per-row zeros/scales (K, N) -> (N, K) fp32: (q - zero) * scale
    in the scales' fp16, as the formats define it."""
    return ((q - zeros).to(scales.dtype) * scales).float().t().contiguous()


def _int_checkpoint(
    src: Path, out: Path, reference: Path,
    quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]],
    config: dict[str, Any], projections: re.Pattern[str] = PROJECTION,
) -> tuple[Path, Path]:  # fmt: skip
    plain: dict[str, torch.Tensor] = {}

    def convert(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if not projections.match(name):
            return {name: tensor}
        stored, dequantized_weight = quantize(name.removesuffix(".weight"), tensor.float())
        plain[name] = dequantized_weight
        return stored

    _rewrite(src, out, convert, config)
    _rewrite(src, reference, lambda name, tensor: {name: plain.get(name, tensor)}, None)
    return out, reference


def quantize_gptq(
    src: Path, out: Path, reference: Path, group: int = 32, act_order: bool = False,
    projections: re.Pattern[str] = PROJECTION,
) -> tuple[Path, Path]:  # fmt: skip
    """A 4-bit symmetric GPTQ checkpoint (v1 ``checkpoint_format: gptq``: zero points stored
    less one), with act-order's permuted g_idx where asked; and its dequantized twin.
    ``projections``: the weights quantized (an MoE family's experts have other names)."""
    rng = torch.Generator().manual_seed(5)

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        k = weight.shape[1]
        order = torch.randperm(k, generator=rng) if act_order else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // group
        q, zeros, scales = _int_groups(weight, g_idx, k // group, 4, symmetric=True)
        stored = {
            f"{module}.qweight": _pack_rows(q, 4),
            f"{module}.qzeros": _pack_columns((zeros - 1) & 0xF, 4),
            f"{module}.scales": scales,
            f"{module}.g_idx": g_idx,
        }
        return stored, _int_dequantize(q, zeros[g_idx.long()], scales[g_idx.long()])

    config = {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
        "sym": True, "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
        "checkpoint_format": "gptq", "model_name_or_path": None,
        "model_file_base_name": None, "quantizer": ["gptqmodel:2.2.0"], "pack_dtype": "int32",
        "lm_head": False, "meta": {"quantizer": ["gptqmodel:2.2.0"]},
    }  # fmt: skip
    return _int_checkpoint(src, out, reference, quantize, config, projections)


def quantize_awq(
    src: Path, out: Path, reference: Path, group: int = 32,
    projections: re.Pattern[str] = PROJECTION, skip: tuple[str, ...] | None = None,
) -> tuple[Path, Path]:  # fmt: skip
    """A 4-bit AWQ GEMM checkpoint (AutoAWQ's interleaved packing), and its dequantized twin;
    ``skip``: its modules_to_not_convert."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        k = weight.shape[1]
        group_of = torch.arange(k) // group
        q, zeros, scales = _int_groups(weight, group_of, k // group, 4, symmetric=False)
        stored = {
            f"{module}.qweight": _pack_columns(q, 4, order),
            f"{module}.qzeros": _pack_columns(zeros, 4, order),
            f"{module}.scales": scales,
        }
        return stored, _int_dequantize(q, zeros[group_of], scales[group_of])

    config = {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None if skip is None else list(skip),
    }  # fmt: skip
    return _int_checkpoint(src, out, reference, quantize, config, projections)
