"""gpt-oss MXFP4 checkpoints run natively, experts kept as stored, with transformers' tokens.

The checkpoint is the zoo's tiny gpt-oss with its experts written in the
releases' on-disk MXFP4 layout (``tests/mxfp4_checkpoints.py``); the reference
is transformers 5.25 loading that same checkpoint with its own dequantizer
(``Mxfp4Config(dequantize=True)``) in fp32. Logits and greedy tokens are
checked as for the other formats (``test_quantized_models._check_matches``:
near ties printed, not hidden).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import Engine
from batchgen.kernels import quant_reference as qref
from batchgen.kernels.cpu import routed_experts
from batchgen.kernels.cpu.routed_experts import dequantize_expert
from batchgen.kernels.experts import ClampedSwiGLU, ExpertWeights, Mxfp4ExpertWeights
from batchgen.kernels.ops import CPU_OPS
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.registry import load_model_config
from tests.family_parity import engine_prompt_logits, random_prompts
from tests.model_zoo import VOCAB
from tests.mxfp4_checkpoints import mxfp4, quantize_mxfp4
from tests.test_quantized_models import _check_matches, _model_bytes


@functools.lru_cache(maxsize=2)
def _transformers_dequantized(path: Path) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager",
        quantization_config=Mxfp4Config(dequantize=True),
    )  # fmt: skip
    return model.eval()


def _experts(engine: Engine) -> list[Any]:
    return [x.mlp.experts for x in engine.runner.model.weights.layers]  # type: ignore[attr-defined]


def test_mxfp4_writer_round_trips_through_transformers_dequantizer() -> None:
    """The test's quantizer against transformers' reading of the format: its dequantized
    weight is within half an e2m1 step of the original, and exact where the original
    already was an e2m1 value times the group's power of two."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    w = torch.randn(2, 6, 64)
    w[0, 0, :32] = torch.tensor([0.5, -6.0, 3.0, -0.0] * 8) * 2.0**-3  # exactly representable
    blocks, scales = mxfp4(w)
    back = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(back[0, 0, :32], w[0, 0, :32])
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)  # e2m1 steps are <= 2
    assert bool(((back - w).abs() <= step).all())


@pytest.mark.parametrize("skip", [(), ("model.layers.1.mlp.experts",)])
def test_mxfp4_checkpoint(zoo_model, tmp_path: Path, skip: tuple[str, ...]) -> None:
    path = quantize_mxfp4(zoo_model("gpt_oss"), tmp_path / "mxfp4", skip)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    experts = _experts(engine)
    kinds = [type(x).__name__ for x in experts]
    assert kinds == ["Mxfp4ExpertWeights"] + ["ExpertWeights" if skip else "Mxfp4ExpertWeights"]
    # kept as the checkpoint stores them, bit for bit
    stored = load_file(str(path / "model.safetensors"))
    first = experts[0]
    assert first.gate_up_blocks.dtype == torch.uint8 and first.gate_up_blocks.shape == (
        4,
        64,
        2,
        16,
    )
    assert torch.equal(first.down_scales, stored["model.layers.0.mlp.experts.down_proj_scales"])
    assert isinstance(first.activation, ClampedSwiGLU)

    _check_matches(engine, _transformers_dequantized(path))

    # memory: half a byte per weight and a byte per 32 of them, against 2 bytes in bf16;
    # the whole model holds exactly that less than the plain fp32 one
    quantized = [x for x in experts if isinstance(x, Mxfp4ExpertWeights)]
    weights = sum(2 * x.gate_up_blocks.numel() + 2 * x.down_blocks.numel() for x in quantized)
    packed = [t for x in quantized for t in (x.gate_up_blocks, x.gate_up_scales,
                                              x.down_blocks, x.down_scales)]  # fmt: skip
    held = sum(t.untyped_storage().nbytes() for t in packed)
    assert held == weights // 2 + weights // 32  # 0.266 of bf16's 2 * weights
    plain = Engine.from_pretrained(zoo_model("gpt_oss"), num_kv_blocks=64)
    assert _model_bytes(engine) == _model_bytes(plain) - 4 * weights + held
    print(f"experts: {held} bytes held, bf16 {2 * weights}: {held / (2 * weights):.3f}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_experts_dequantize_one_chosen_expert_at_a_time(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """Bounded memory: only the experts a token chose are dequantized, one per call, and
    the result is bit for bit that of the reference's whole dequantized experts."""
    gen = torch.Generator().manual_seed(3)
    e, hidden, inter = 6, 64, 32
    rand_u8 = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8)  # noqa: E731
    experts = Mxfp4ExpertWeights(
        rand_u8(0, 256, e, 2 * inter, hidden // 32, 16), rand_u8(100, 130, e, 2 * inter, hidden // 32),
        rand_u8(0, 256, e, hidden, inter // 32, 16), rand_u8(100, 130, e, hidden, inter // 32),
        torch.randn(e, 2 * inter, generator=gen).to(dtype), torch.randn(e, hidden, generator=gen).to(dtype),
        ClampedSwiGLU(1.702, 7.0),
    )  # fmt: skip
    x = torch.randn(5, hidden, generator=gen).to(dtype)
    ids = torch.tensor([[4, 1], [1, 4], [4, 2], [2, 1], [1, 4]])
    weights = torch.rand(5, 2, generator=gen)
    calls: list[int] = []

    def spy(some: Mxfp4ExpertWeights, expert: int, to: torch.dtype) -> ExpertWeights:
        calls.append(expert)
        return dequantize_expert(some, expert, to)

    monkeypatch.setattr(routed_experts, "dequantize_expert", spy)
    out = CPU_OPS.fused_moe(x, experts, weights, ids)
    assert calls == [1, 2, 4]  # never 0, 3 or 5
    whole = qref.dequantize_mxfp4_experts(experts)
    assert whole.b13 is not None and whole.b2 is not None
    w13, w2, b13, b2 = (t.to(dtype) for t in (whole.w13, whole.w2, whole.b13, whole.b2))
    dense = ExpertWeights(w13, w2, b13, b2, experts.activation)
    assert torch.equal(dequantize_expert(experts, 4, dtype).w2[0], dense.w2[4])
    assert torch.equal(out, CPU_OPS.fused_moe(x, dense, weights, ids))


def _edit(
    path: Path,
    out: Path,
    config: dict | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
) -> Path:
    import shutil

    shutil.copytree(path, out)
    stored = load_file(str(out / "model.safetensors"))
    save_file(
        {**stored, **(tensors or {})}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    if config is not None:
        data = json.loads((out / "config.json").read_text())
        data["quantization_config"] = config
        (out / "config.json").write_text(json.dumps(data))
    return out


def test_mxfp4_refusals_name_what_they_refuse(zoo_model, tmp_path: Path) -> None:
    path = quantize_mxfp4(zoo_model("gpt_oss"), tmp_path / "mxfp4")
    edited = _edit(path, tmp_path / "option", {"quant_method": "mxfp4", "swizzle": True})
    with pytest.raises(UnsupportedModelError, match=r"\(mxfp4\) sets swizzle, which batchgen"):
        load_model_config(edited)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    wrong = load_file(str(path / "model.safetensors"))[name].float()
    edited = _edit(path, tmp_path / "dtype", tensors={name: wrong})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(edited, num_kv_blocks=16)
    assert f"tensor '{name}': torch.float32 (4, 64, 1), not the uint8 (4, 64, 1)" in str(
        refused.value
    )
    # an mxfp4 config over plain experts: the blocks it needs are named, never guessed
    plain = _edit(zoo_model("gpt_oss"), tmp_path / "plain", {"quant_method": "mxfp4"})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(plain, num_kv_blocks=16)
    assert "lacks tensor 'model.layers.0.mlp.experts.gate_up_proj_blocks'" in str(refused.value)


def test_mxfp4_checkpoint_on_the_triton_ops_equals_the_cpu_path(zoo_model, tmp_path: Path) -> None:
    """The GPU path: the fused-MoE kernel dequantizing the loaded experts inside its loop
    (Triton's interpreter off CUDA) gives the CPU path's logits."""
    pytest.importorskip("triton")
    path = quantize_mxfp4(zoo_model("gpt_oss"), tmp_path / "mxfp4")
    triton, cpu = (
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=use, max_num_batched_tokens=12)
        for use in (True, False)
    )
    assert triton.runner.model.ops.name == "triton"
    assert isinstance(_experts(triton)[0], Mxfp4ExpertWeights)
    (tokens,) = random_prompts(VOCAB, (20,), seed=13)  # two chunks, past the window of 8
    got, _ = engine_prompt_logits(triton, tokens)
    expected, _ = engine_prompt_logits(cpu, tokens)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
