"""FP8 checkpoints whose inputs are quantized too: compressed-tensors FP8 with static input
scales.

Each checkpoint is tiny and random, written offline in the release layout by the
compressed-tensors library with scales calibrated on a short prompt
(``tests/quant_checkpoints.py``), so longer prompts go past them and clamp. The
reference is transformers' own load of the same checkpoint: compressed-tensors'
forward with its static scales. Greedy tokens equal, near ties printed
(``_check_matches``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import Engine
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant import QuantizedLinear
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight, StaticFp8Input
from batchgen.worker.models.registry import load_model_config
from tests.quant_checkpoints import compress
from tests.test_quantized_models import (
    _check_matches,
    _projections,
    _with_quantization,
)


def _quantized_parts(engine: Engine) -> tuple[list[QuantizedLinear], list[CompressedWeight]]:
    projections = [p for p in _projections(engine) if isinstance(p, QuantizedLinear)]
    parts = [q for p in projections for q in p.parts if isinstance(q, CompressedWeight)]
    return projections, parts


def test_static_input_is_compressed_tensors_quantize_dequantize() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    args = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)
    torch.manual_seed(0)
    x = torch.randn(5, 64) * 3
    scale = torch.tensor([0.004])  # 448 * 0.004 = 1.79: the larger inputs clamp
    assert (x.abs() > 448 * scale).any()
    mine = StaticFp8Input(float(scale), torch.float32)(x)
    assert torch.equal(mine, fake_quantize(x, scale, None, args))


def _static_reference(path: Path) -> tuple[Any, list[int]]:
    """transformers' own load (compressed-tensors' forward with its static input scales),
    and how many inputs each of its forwards clamped."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=CompressedTensorsConfig(run_compressed=True),
    )  # fmt: skip
    model.eval()
    clamped: list[int] = []
    for module in model.modules():
        if getattr(module, "input_scale", None) is not None:
            module.register_forward_pre_hook(
                lambda m, inputs: clamped.append(int((inputs[0].abs() > 448 * m.input_scale).sum()))
            )
    return model, clamped


@pytest.mark.parametrize("scheme", ["fp8-static", "fp8-static-channel"])
def test_compressed_tensors_static_fp8(zoo_model, tmp_path: Path, scheme: str) -> None:
    path = compress(zoo_model("llama"), tmp_path / scheme, scheme)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    projections, parts = _quantized_parts(engine)
    assert len(projections) == 8 and len(parts) == 14
    assert all(q.values.dtype == torch.float8_e4m3fn for q in parts)
    shape = (1,) if scheme == "fp8-static" else None
    assert all(q.scale.shape == (shape or (q.out_features, 1)) for q in parts)
    stored = load_file(str(path / "model.safetensors"))
    for projection, name in zip(projections, ("self_attn.q_proj", "self_attn.o_proj")):
        scale = stored[f"model.layers.0.{name}.input_scale"]
        assert projection.quantize_input == StaticFp8Input(float(scale), torch.float32)
    reference, clamped = _static_reference(path)
    _check_matches(engine, reference)
    assert sum(clamped) > 0  # inputs past the calibrated range were clamped


def test_fused_projections_with_different_static_scales_are_refused(
    zoo_model, tmp_path: Path
) -> None:
    """q, k and v share one input; scales that differ would quantize it three ways."""
    path = compress(zoo_model("llama"), tmp_path / "ct", "fp8-static")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.input_scale"] *= 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="quantize their input differently"):
        Engine.from_pretrained(path, num_kv_blocks=16)


STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
          "dynamic": False}  # fmt: skip
FP8_W = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor"}


def _ct_static(
    acts: dict[str, Any], weights: dict[str, Any] = FP8_W, fmt: str = "float-quantized"
) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts,
             "format": fmt}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": fmt,
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_ct_static({**STATIC, "type": "int"}),
         "type='int' is not supported (static input scales run for FP8 inputs)"),
        (_ct_static({**STATIC, "strategy": "channel"}),
         "input_activations): strategy='channel' is not supported (batchgen runs 'tensor')"),
        (_ct_static({**STATIC, "symmetric": False}), "symmetric=False is not supported"),
        (_ct_static({**STATIC, "dynamic": "local"}), "dynamic='local' is not supported"),
        (_ct_static(STATIC, {"num_bits": 8, "type": "int", "symmetric": True,
                             "strategy": "channel"}, "int-quantized"),
         "static FP8 input scales with FP8 weights"),
    ],
)  # fmt: skip
def test_unsupported_options_are_refused_by_name(
    zoo_model, tmp_path: Path, config: dict, message: str
) -> None:
    path = _with_quantization(tmp_path, zoo_model("llama"), config)
    with pytest.raises(UnsupportedModelError) as refused:
        load_model_config(path)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_static_config_over_a_checkpoint_without_input_scales_is_refused(
    zoo_model, tmp_path: Path
) -> None:
    path = compress(zoo_model("llama"), tmp_path / "ct", "fp8-static")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.input_scale"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"lacks tensor .*q_proj\.input_scale"):
        Engine.from_pretrained(path, num_kv_blocks=16)
