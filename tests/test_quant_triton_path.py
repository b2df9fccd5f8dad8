"""Quantized checkpoints on the engine's Triton ops (the interpreter off CUDA): each quantized
projection runs its format's Triton GEMM on the weights as stored, and the tokens are the
CPU path's (which dequantizes a tile at a time in torch)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.kernels import quant_reference
from batchgen.kernels.experts import Fp8BlockExpertWeights
from batchgen.worker.models.quant import QuantizedLinear, QuantizedWeight
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from tests.family_parity import engine_prompt_logits, random_prompts
from tests.model_zoo import VOCAB
from tests.quant_checkpoints import compress, quantize_awq, quantize_fp8_block, quantize_gptq

pytest.importorskip("triton")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # not an expert's: kept plain


class Launches:
    """Counts a Triton kernel's launches (``kernel[grid](...)``) and passes them on."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid: Any) -> Any:
        launch = self.kernel[grid]

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return launch(*args, **kwargs)

        return counted


def _checkpoint(kind: str, zoo_model: Any, tmp_path: Path) -> Path:
    if kind == "fp8-block":
        return quantize_fp8_block(zoo_model("llama"), tmp_path / kind, (32, 32))
    if kind == "w4a16-asym":
        return compress(zoo_model("llama"), tmp_path / kind, kind)
    src, out, plain = zoo_model("qwen3"), tmp_path / kind, tmp_path / "plain"
    if kind == "awq":
        return quantize_awq(src, out, plain)[0]
    path, _ = quantize_gptq(src, out, plain, act_order=kind == "gptq-act-order")
    if kind == "gptq-v2":  # the same words read with the zero points as stored, not plus one
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"]["checkpoint_format"] = "gptq_v2"
        (path / "config.json").write_text(json.dumps(config))
    return path


def _w8a8_reference(part: QuantizedWeight) -> Any:
    assert isinstance(part, Fp8BlockWeight)
    return functools.partial(
        quant_reference.w8a8_block_fp8_linear, weight=part.weight,
        weight_scale_inv=part.scale_inv, block_size=part.block,
    )  # fmt: skip


def _projections(engine: Engine) -> list[QuantizedLinear]:
    layers = engine.runner.model.weights.layers  # type: ignore[attr-defined]
    found = [p for x in layers for p in (x.attention.qkv, x.attention.o, x.mlp.up, x.mlp.down)]
    assert all(isinstance(p, QuantizedLinear) for p in found)
    return found


def _stored(engine: Engine) -> list[torch.dtype]:
    return [t.dtype for p in _projections(engine) for q in p.parts for t in q.tensors()]


# parts per projection (q/k/v, o, gate/up, down) and the GEMM launches of a 2-layer prefill
FUSED, PER_PART = ((1, 1, 1, 1), 8), ((3, 1, 2, 1), 14)


@pytest.mark.parametrize(
    ("kind", "kernel", "stored", "launches", "atol"),
    [
        # w8a8: the Triton GEMM quantizes each token's input per group of 32 columns to e4m3
        # (DeepSeek-V3's GPU math), the CPU path runs it unquantized (transformers'
        # dequantized model): the reference is the CPU path with quant_reference's w8a8.
        # q/k/v (64, 32, 32 rows) and gate/up (128 each) are whole blocks of 32: joined
        ("fp8-block", "fp8", torch.float8_e4m3fn, FUSED, 2e-4),
        # W4A16: the GEMM forms each weight as the CPU path does, (q - z) * s in the scales'
        # dtype, so only the order of the sums differs
        ("gptq", "w4a16", torch.int32, FUSED, 2e-4),
        # each module's own act-order permutation (tests/quant_checkpoints.py): q/k/v's and
        # gate/up's g_idx differ, so they cannot join and run one GEMM per part
        ("gptq-act-order", "w4a16", torch.int32, PER_PART, 2e-4),
        ("gptq-v2", "w4a16", torch.int32, FUSED, 2e-4),
        ("awq", "w4a16", torch.int32, FUSED, 2e-4),
        ("w4a16-asym", "w4a16", torch.int32, FUSED, 2e-4),
    ],
)
def test_quantized_projections_run_the_triton_gemms_as_stored(
    zoo_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, kernel: str,
    stored: torch.dtype, launches: tuple[tuple[int, ...], int], atol: float,
) -> None:  # fmt: skip
    from batchgen.kernels.triton import fp8_gemm, w4a16_gemm

    path = _checkpoint(kind, zoo_model, tmp_path)
    triton, cpu = (
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=use, max_num_batched_tokens=12)
        for use in (True, False)
    )
    assert triton.runner.model.ops.name == "triton"
    # kept in the checkpoint's format on both paths (the same dtypes); on the Triton ops a
    # fused projection's parts are joined into one where they can, the same weight bit for bit
    assert set(_stored(triton)) == set(_stored(cpu)) and _stored(triton)[0] == stored
    parts, expected_launches = launches
    assert [len(p.parts) for p in _projections(triton)] == list(parts) * 2
    assert [len(p.parts) for p in _projections(cpu)] == [3, 1, 2, 1] * 2
    for fused, plain in zip(_projections(triton), _projections(cpu), strict=True):
        assert torch.equal(fused.dequantized(), plain.dequantized())
    assert all(p.kernels is not None for p in _projections(triton))
    assert [len(p.kernels or ()) for p in _projections(triton)] == list(parts) * 2
    assert all(p.kernels is None for p in _projections(cpu))

    module, name = (fp8_gemm, "_w8a8_block_fp8_kernel") if kernel == "fp8" else (
        w4a16_gemm, "_w4a16_kernel"
    )  # fmt: skip
    counted = Launches(getattr(module, name))
    monkeypatch.setattr(module, name, counted)
    dequantized: list[int] = []
    for part in {type(q) for p in _projections(triton) for q in p.parts}:
        assert issubclass(part, QuantizedWeight)
        original = part.dequantize

        def counting(self: Any, start: int, stop: int, _original: Any = original) -> Any:
            dequantized.append(stop - start)
            return _original(self, start, stop)

        monkeypatch.setattr(part, "dequantize", counting)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    triton.add_request("one", list(range(40, 47)), params)
    triton.step()  # one prefill: a GEMM per part of qkv, o, gate/up, down in 2 layers
    assert counted.count == expected_launches and dequantized == []
    cpu.add_request("one", list(range(40, 47)), params)
    cpu.step()
    assert counted.count == expected_launches  # the CPU path: tiles in torch, no GEMM
    assert len(dequantized) >= 14
    dequantized.clear()
    if kind == "fp8-block":  # the reference quantizes the input as the GEMM does
        for p in _projections(cpu):
            p.kernels = tuple(_w8a8_reference(q) for q in p.parts)

    (tokens,) = random_prompts(VOCAB, (20,), seed=13)  # two chunks of 12
    got, _ = engine_prompt_logits(triton, tokens)
    expected, _ = engine_prompt_logits(cpu, tokens)
    torch.testing.assert_close(got, expected, atol=atol, rtol=0)
    prompts = random_prompts(VOCAB, (3, 9), seed=14)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in triton.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]


def test_formats_without_a_gemm_keep_the_tiled_product(zoo_model, tmp_path: Path) -> None:
    """W8A8 int8 (its input quantized first) has no Triton GEMM: on the Triton ops it runs
    the product the CPU path runs, with the same tokens."""
    path = compress(zoo_model("llama"), tmp_path / "w8a8", "w8a8-int8")
    triton, cpu = (
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=use) for use in (True, False)
    )
    assert all(p.kernels is None and p.int8 is not None for p in _projections(triton))
    prompts = random_prompts(VOCAB, (3, 9), seed=14)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    assert [o.token_ids for o in triton.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]


def test_fp8_experts_stay_fp8_in_the_fused_moe(
    zoo_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Block-FP8 routed experts (gate's last block of rows partial: 32 rows in blocks of 24)
    are kept as stored on the Triton ops too, and the fused-MoE GEMMs read them as e4m3
    and block scales (two launches a step: gate/up, down); tokens equal the CPU path's."""
    from batchgen.kernels.triton import fused_moe

    experts_only = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight$")
    plain = ("lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate", *DENSE_MLP)
    path = quantize_fp8_block(
        zoo_model("qwen3_moe"), tmp_path / "fp8", (24, 32), plain, experts_only
    )
    triton, cpu = (
        Engine.from_pretrained(path, num_kv_blocks=16, use_triton=use, max_num_batched_tokens=12)
        for use in (True, False)
    )
    for engine in (triton, cpu):
        experts = engine.runner.model.weights.layers[1].mlp.experts  # type: ignore[attr-defined]
        assert isinstance(experts, Fp8BlockExpertWeights)
        assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up.shape == (8, 64, 64)
    fp8_launches: list[bool] = []
    kernel = fused_moe._grouped_gemm_kernel

    class Spy:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **kwargs: Any) -> Any:
                fp8_launches.append(kwargs["FP8_BLOCK"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(fused_moe, "_grouped_gemm_kernel", Spy())
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    triton.add_request("one", list(range(40, 47)), params)
    triton.step()
    assert fp8_launches == [True, True]

    (tokens,) = random_prompts(VOCAB, (20,), seed=13)
    got, _ = engine_prompt_logits(triton, tokens)
    expected, _ = engine_prompt_logits(cpu, tokens)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)
    prompts = random_prompts(VOCAB, (3, 9), seed=14)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert [o.token_ids for o in triton.generate(prompts, params)] == [
        o.token_ids for o in cpu.generate(prompts, params)
    ]
