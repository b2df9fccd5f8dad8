"""FP8 checkpoints whose inputs are quantized too: fbgemm FP8 (dynamic per token, bounded by
``activation_scale_ub``) and compressed-tensors FP8 with static input scales.

Each checkpoint is tiny and random, written offline in the release layout:
fbgemm's by its definition (``tests/fbgemm_checkpoints.py``), compressed-tensors'
by the compressed-tensors library with scales calibrated on a short prompt
(``tests/quant_checkpoints.py``), so longer prompts go past them and clamp. The
reference is transformers' own load of the same checkpoint: compressed-tensors'
forward with its static scales; for fbgemm, ``FbgemmFp8Linear`` with fbgemm's two
CUDA ops written in plain torch. Greedy tokens equal, near ties printed
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
from batchgen.worker.models.quant.compressed_tensors import (
    ActivationArgs,
    CompressedWeight,
    StaticFp8Input,
)
from batchgen.worker.models.quant.fbgemm_fp8 import RowwiseFp8Input
from tests.fbgemm_checkpoints import fbgemm_reference, quantize_fbgemm_fp8
from tests.quant_checkpoints import compress
from tests.test_quantized_models import LOGIT_ATOL, _check_matches, _projections, config_refusal


def _quantized_parts(engine: Engine) -> tuple[list[QuantizedLinear], list[CompressedWeight]]:
    projections = [p for p in _projections(engine) if isinstance(p, QuantizedLinear)]
    parts = [q for p in projections for q in p.parts if isinstance(q, CompressedWeight)]
    return projections, parts


def test_rowwise_input_is_fbgemms_quantize_fp8_per_row() -> None:
    """Rows past the bound saturate at it; a row below 448 / 229376 keeps the smallest scale
    fbgemm allows; each row's scale is its own."""
    act = RowwiseFp8Input(bound=8.0)
    x = torch.tensor([[16.0, -12.0, 4.0, 1.0], [1e-4, -2e-4, 0.0, 0.0], [0.0] * 4,
                      [448.0, 3.0, -1.0, 0.5]])  # fmt: skip
    out = act(x)
    bounded, floor = torch.tensor(8.0) / 448, torch.tensor(1.0) / (448 * 512)
    # row 0: amax 16 bounded to 8; 16 and -12 saturate at +-448, 4 -> 224, 1 -> 56
    assert torch.equal(out[0], torch.tensor([448.0, -448.0, 224.0, 56.0]) * bounded)
    # row 1: the floor scale: 1e-4 -> 22.94 -> e4m3 22, -2e-4 -> -45.88 -> -44
    assert torch.equal(out[1], torch.tensor([22.0, -44.0, 0.0, 0.0]) * floor)
    assert torch.equal(out[2], torch.zeros(4))
    # row 3: 448 saturates at the bound; 3 -> 168, halfway between e4m3's 160 and 176,
    # rounds to the even 160; -1 -> -56, 0.5 -> 28
    assert torch.equal(out[3], torch.tensor([448.0, 160.0, -56.0, 28.0]) * bounded)
    wide = RowwiseFp8Input(bound=1200.0)(x)
    assert wide[3].tolist() == [448.0, 3.0, -1.0, 0.5] and wide[0, 0] == 16.0


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dynamic_fp8_input_saturates_where_its_scale_is_subnormal(dtype: torch.dtype) -> None:
    """FP8-dynamic's per-token input (``ActivationArgs("float")``) is quantized in x's dtype.
    A normal scale, amax / 448, is exact to half an ulp, so amax / scale rounds to 448; a
    subnormal one is coarser: amax = 627 subnormal ulps gives 1.4 ulps, rounded to 1, and
    amax / scale = 627, past e4m3's range (fp16's subnormals start at 6.1e-5: a small row,
    not an absurd one). The clamp makes it 448 as compressed-tensors' forward does, whatever
    the cast does past 448 (torch 2.13's saturates by itself: finite overflow -> +-448)."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    ulp = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # the least subnormal
    x = torch.tensor([[627.0, -300.0, 5.0, 0.0], [-627.0, 2.0, 1.0, -1.0]]) * ulp
    x = torch.cat((x, torch.tensor([[0.5, -3.0, 1.0, 2.0]]))).to(dtype)  # a plain row
    act = ActivationArgs("float")
    rounded, scale = act.quantize(x)
    assert scale[:2].flatten().tolist() == [ulp, ulp] and (x[:2] / scale[:2]).abs().max() == 627
    assert rounded[:2, 0].float().tolist() == [448.0, -448.0]
    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True)
    scale_ct, _ = compute_dynamic_scales_and_zp(x[None], args, torch.nn.Identity())
    assert torch.equal(act(x), fake_quantize(x[None], scale_ct, None, args)[0])
    assert act(x).isfinite().all()


@pytest.mark.parametrize(
    ("skip", "bound", "plain"),
    [
        (None, None, 0),  # FbgemmFp8Config's defaults: ub 1200, the LM head plain
        # attention left plain, as Meta's Llama-3.1-405B-FP8 leaves it; a bound rows go past
        ([r"model.layers.\d+.self_attn", "lm_head"], 1.5, 4),
    ],
)
def test_fbgemm_fp8_checkpoint(
    zoo_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skip: list[str] | None,
    bound: float | None, plain: int,
) -> None:  # fmt: skip
    path = quantize_fbgemm_fp8(zoo_model("llama"), tmp_path / "fbgemm", skip, bound)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    kinds = [type(p).__name__ for p in _projections(engine)]
    assert kinds.count("Linear") == plain and kinds.count("QuantizedLinear") == 8 - plain
    projections, parts = _quantized_parts(engine)
    assert len(parts) == (14 if plain == 0 else 6)  # q, k, v, o, gate, up, down per layer
    assert all(q.values.dtype == torch.float8_e4m3fn for q in parts)
    assert all(q.scale.dtype == torch.float32 and q.scale.shape == (q.out_features, 1)
               for q in parts)  # fmt: skip
    assert {p.quantize_input for p in projections} == {RowwiseFp8Input(bound or 1200.0)}
    bf16 = sum(2 * q.out_features * q.in_features for q in parts)
    assert sum(p.nbytes for p in projections) < 0.55 * bf16
    reference = fbgemm_reference(path, monkeypatch)
    tops: list[float] = []
    for module in reference.modules():
        if type(module).__name__ == "FbgemmFp8Linear":
            module.register_forward_pre_hook(
                lambda m, inputs: tops.append(float(inputs[0].abs().amax()))
            )
    # fbgemm scales the e4m3 sums, the CPU product the e4m3 values before summing: the
    # last bit differs, and where it flips one activation's e4m3 rounding downstream a
    # logit moves further (bound 1.5: 1 of 70 rows, 3.2e-4; the reference with the
    # scales applied first matches it within 6e-6)
    _check_matches(engine, reference, atol=1e-3 if bound else LOGIT_ATOL)
    assert max(tops) > (bound or 0)  # with a bound, some rows' largest input is past it


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
        ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 0},
         "(fbgemm_fp8): activation_scale_ub=0 is not supported (a positive number)"),
        ({"quant_method": "fbgemm_fp8", "activation_scale_ub": "1200"},
         "activation_scale_ub='1200' is not supported"),
        ({"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["model.layers.0.mlp"]},
         "modules_to_not_convert=['model.layers.0.mlp'] is not supported (it leaves lm_head "
         "quantized)"),
        ({"quant_method": "fbgemm_fp8", "input_scale_ub": 3.0},
         "(fbgemm_fp8) sets input_scale_ub, which batchgen does not read"),
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
    assert message in config_refusal(tmp_path, zoo_model("llama"), config)


def test_static_config_over_a_checkpoint_without_input_scales_is_refused(
    zoo_model, tmp_path: Path
) -> None:
    path = compress(zoo_model("llama"), tmp_path / "ct", "fp8-static")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.q_proj.input_scale"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"lacks tensor .*q_proj\.input_scale"):
        Engine.from_pretrained(path, num_kv_blocks=16)
