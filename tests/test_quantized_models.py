"""Quantized checkpoints run natively, kept quantized, with transformers' dequantized tokens.

Each format is a tiny random checkpoint written offline in the hub releases'
on-disk layout (``tests/quant_checkpoints.py``). The reference is
transformers in fp32 on the dequantized weights: its own dequantizing loader
where it has one for the shape, else the checkpoint dequantized by the
format's definition and loaded as a plain one. Greedy tokens must be equal;
a first difference is allowed only at a near tie (top-2 logit gap <= 2e-3 in
the reference), and every such tie is printed, not hidden.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchgen import Engine, SamplingParams
from batchgen.worker.models import UnsupportedModelError
from batchgen.worker.models.quant import QuantizedLinear
from batchgen.worker.models.quant import linear as quant_linear
from batchgen.worker.models.quant.awq import AwqWeight
from batchgen.worker.models.quant.compressed_tensors import CompressedWeight
from batchgen.worker.models.quant.fp8 import Fp8BlockWeight
from batchgen.worker.models.quant.gptq import GptqWeight
from batchgen.worker.models.registry import load_model_config
from batchgen.worker.models.weights import Linear, linear
from tests.family_parity import engine_prompt_logits, random_prompts
from tests.fbgemm_checkpoints import quantize_fbgemm_fp8
from tests.hf_reference import hf_model
from tests.model_zoo import VOCAB
from tests.quant_checkpoints import (
    compress,
    compressed_reference,
    dequantized,
    fp8_block,
    quantize_awq,
    quantize_fp8_block,
    quantize_gptq,
)

NEAR_TIE = 2e-3  # a reference top-2 gap this small may flip on summation order alone
LOGIT_ATOL = 2e-4  # fp32, as the families' parity tests


def _fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> Fp8BlockWeight:
    torch.manual_seed(seed)
    q, scale = fp8_block(torch.randn(n, k), block)
    return Fp8BlockWeight(q, scale, block)


def test_tiled_product_equals_dequantize_then_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of two blocks, grids that do not divide the shape, fused parts and a bias: the
    product of the whole dequantized weight, bit for bit where every tile is as wide (MKL's
    columns then sum alike), within fp32 rounding where a narrow last tile takes another
    kernel."""
    monkeypatch.setattr(quant_linear, "TILE_BYTES", 4 * 72 * 40)  # 40 columns of 72 inputs
    even = (_fp8_weight(96, 72, (16, 40), 0), _fp8_weight(64, 72, (16, 40), 1))
    ragged = (_fp8_weight(100, 72, (16, 40), 2), _fp8_weight(37, 72, (16, 40), 3))
    assert quant_linear._tiles(ragged[0]) == [(0, 32), (32, 64), (64, 96), (96, 100)]
    for parts, exact in ((even, True), (ragged, False)):
        out = sum(p.out_features for p in parts)
        bias = torch.randn(out)
        layer = QuantizedLinear(
            torch.empty(72, out, device="meta"), bias, decided=True, parts=parts
        )
        whole = layer.dequantized()
        assert whole.shape == (72, out)
        # the format's definition: the fp8 value times its block's scale
        q, scale = parts[0].weight, parts[0].scale_inv
        assert whole[41, 90] == q[90, 41].float() * scale[90 // 16, 41 // 40]
        for rows in (1, 5, 33):
            x = torch.randn(rows, 72)
            if exact:
                assert torch.equal(layer(x), linear(x, whole, bias))
            else:
                torch.testing.assert_close(layer(x), linear(x, whole, bias), rtol=1e-6, atol=1e-5)


def _model_bytes(engine: Engine) -> int:
    """Bytes of every tensor the native decoder's weights hold (each storage once)."""
    seen: dict[int, int] = {}

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":
                seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))

    walk(engine.runner.model.weights)  # type: ignore[attr-defined]
    return sum(seen.values())


def _projections(engine: Engine) -> list[Linear]:
    layers = engine.runner.model.weights.layers  # type: ignore[attr-defined]
    return [p for x in layers for p in (x.attention.qkv, x.attention.o, x.mlp.up, x.mlp.down)]


def _reference_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def _reference_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    saved, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    finally:
        model.generation_config.eos_token_id = saved
    return out[0, len(prompt) :].tolist()


def _check_matches(engine: Engine, reference: Any, atol: float = LOGIT_ATOL) -> list[str]:
    """Teacher-forced logits and greedy tokens against the transformers model
    ``reference``; the near ties met, described (and printed)."""
    (tokens,) = random_prompts(VOCAB, (70,), seed=11)
    logits, _ = engine_prompt_logits(engine, tokens)
    expected = _reference_logits(reference, tokens)
    off = (logits - expected).abs().amax(dim=-1)
    print(f"logits: {int((off > LOGIT_ATOL).sum())} of {len(off)} rows off by more than "
          f"{LOGIT_ATOL}, at most {float(off.max()):.2e}")  # fmt: skip
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    prompts = random_prompts(VOCAB, (1, 6, 17, 40), seed=12)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    ties = []
    for prompt, out in zip(prompts, got):
        ref = _reference_greedy(reference, prompt, 8)
        if out != ref:
            i = next(i for i, (a, b) in enumerate(zip(ref, out)) if a != b)
            top2 = _reference_logits(reference, prompt + ref[:i])[-1].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap <= NEAR_TIE, (len(prompt), i, ref, out, gap)
            ties.append(f"prompt of {len(prompt)}: token {i} differs at a gap of {gap:.2e}")
    assert len({tuple(o) for o in got}) > 1
    print("near ties:", ties or "none")
    return ties


@pytest.mark.parametrize(
    ("zoo", "block", "reference"),
    [
        ("llama", (32, 32), "transformers"),  # transformers' FP8 loader dequantizes it
        ("qwen3", (24, 40), "definition"),  # partial blocks: transformers refuses the grid
    ],
)
def test_fp8_block_checkpoint(
    zoo_model, tmp_path: Path, zoo: str, block: tuple[int, int], reference: str
) -> None:
    path = quantize_fp8_block(zoo_model(zoo), tmp_path / "fp8", block)
    ref = path if reference == "transformers" else dequantized(path, tmp_path / "plain")
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    # kept quantized: every decoder projection holds fp8 + scales, in the checkpoint's layout
    projections = [p for p in _projections(engine) if isinstance(p, QuantizedLinear)]
    assert len(projections) == 8
    parts = [q for p in projections for q in p.parts if isinstance(q, Fp8BlockWeight)]
    assert len(parts) == 14  # q, k, v, o, gate, up, down of 2 layers
    assert parts[0].weight.dtype == torch.float8_e4m3fn and parts[0].weight.shape == (64, 64)
    assert parts[0].scale_inv.shape == (-(-64 // block[0]), -(-64 // block[1]))

    _check_matches(engine, hf_model(ref))

    # memory: the plain fp32 model less 3 bytes of every projection weight, plus the scales
    plain_path = ref if ref != path else dequantized(path, tmp_path / "plain")
    plain = Engine.from_pretrained(plain_path, num_kv_blocks=64, max_num_batched_tokens=24)
    weights = sum(q.weight.numel() for q in parts)
    scales = sum(q.scale_inv.nbytes for q in parts)
    assert _model_bytes(engine) == _model_bytes(plain) - 3 * weights + scales
    assert sum(p.nbytes for p in projections) < 0.55 * 2 * weights  # about half of bf16


def test_modules_to_not_convert_stay_plain(zoo_model, tmp_path: Path) -> None:
    skip = ("model.layers.1.mlp.down_proj",)
    path = quantize_fp8_block(zoo_model("llama"), tmp_path / "fp8", (32, 32), skip=skip)
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    kinds = [type(p).__name__ for p in _projections(engine)]
    assert kinds == ["QuantizedLinear"] * 7 + ["Linear"]
    _check_matches(engine, hf_model(path))


@pytest.mark.parametrize(
    ("scheme", "stored", "bf16_fraction"),
    [
        ("w4a16", torch.int32, 0.35),  # 4 bits + an fp32 scale per 32: 0.28 of bf16
        ("w4a16-asym", torch.int32, 0.4),  # + a 4-bit zero point per 16
        ("w8a8-int8", torch.int8, 0.55),
        ("fp8-dynamic", torch.float8_e4m3fn, 0.55),
    ],
)
def test_compressed_tensors_checkpoint(
    zoo_model, tmp_path: Path, scheme: str, stored: torch.dtype, bf16_fraction: float
) -> None:
    """Written by the compressed-tensors library; the reference is transformers'
    decompressed model with compressed-tensors' dynamic activation quantization."""
    path = compress(zoo_model("llama"), tmp_path / scheme, scheme)
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    projections = [p for p in _projections(engine) if isinstance(p, QuantizedLinear)]
    assert len(projections) == 8
    parts = [q for p in projections for q in p.parts if isinstance(q, CompressedWeight)]
    assert len(parts) == 14 and all(q.values.dtype == stored for q in parts)
    bf16 = sum(2 * q.out_features * q.in_features for q in parts)
    assert sum(p.nbytes for p in projections) < bf16_fraction * bf16
    # int8 activations: compressed-tensors' per-token scale is amax / 127.5, so a token whose
    # largest activation is negative sits on the -127.5 rounding boundary, where a last-bit
    # difference upstream (attention's summation order) picks -128 or -127: up to 0.1 apart
    # on 45 of the 70 rows here; greedy tokens must still be equal
    _check_matches(
        engine, compressed_reference(path), atol=0.15 if scheme == "w8a8-int8" else LOGIT_ATOL
    )


def test_compressed_tensors_ignore_list(zoo_model, tmp_path: Path) -> None:
    ignore = ("lm_head", "re:.*layers\\.0\\.mlp\\.down_proj$")
    path = compress(zoo_model("llama"), tmp_path / "w4", "w4a16-asym", ignore=ignore)
    engine = Engine.from_pretrained(path, num_kv_blocks=64)
    kinds = [type(p).__name__ for p in _projections(engine)]
    assert kinds == ["QuantizedLinear"] * 3 + ["Linear"] + ["QuantizedLinear"] * 4
    _check_matches(engine, compressed_reference(path))


@pytest.mark.parametrize("kind", ["gptq", "gptq-act-order", "awq"])
def test_int4_checkpoint(zoo_model, tmp_path: Path, kind: str) -> None:
    """GPTQ (v1 packing, with and without act-order) and AWQ (GEMM packing), written by the
    formats' definitions (no GPTQ/AWQ library installs here); the reference is the same
    checkpoint dequantized by definition, run by transformers as a plain one."""
    src, out, ref = zoo_model("qwen3"), tmp_path / kind, tmp_path / "plain"
    if kind == "awq":
        path, plain = quantize_awq(src, out, ref)
    else:
        path, plain = quantize_gptq(src, out, ref, act_order=kind == "gptq-act-order")
    engine = Engine.from_pretrained(path, num_kv_blocks=64, max_num_batched_tokens=24)
    projections = [p for p in _projections(engine) if isinstance(p, QuantizedLinear)]
    assert len(projections) == 8
    parts = [q for p in projections for q in p.parts]
    assert len(parts) == 14
    assert all(isinstance(q, AwqWeight if kind == "awq" else GptqWeight) for q in parts)
    bf16 = sum(2 * q.out_features * q.in_features for q in parts)
    assert sum(p.nbytes for p in projections) < 0.4 * bf16
    # each projection equals its dequantized twin's weight exactly
    twin = Engine.from_pretrained(plain, num_kv_blocks=8)
    for mine, theirs in zip(projections, _projections(twin)):
        assert torch.equal(mine.dequantized(), theirs.weight)
    _check_matches(engine, hf_model(plain))


def _with_quantization(tmp_path: Path, src: Path, config: dict) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(src, out)
    data = json.loads((out / "config.json").read_text())
    data["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(data))
    return out


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


def _ct(**changes: Any) -> dict[str, Any]:
    """A compressed-tensors W4A16 config (as the library writes it) with changes; a change
    to weights/input_activations/format goes to its one config group."""
    group: dict[str, Any] = {"targets": ["Linear"], "weights": W4, "format": "pack-quantized"}
    for key in ("weights", "input_activations", "format"):
        if key in changes:
            group[key] = changes.pop(key)
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "config_groups": {"group_0": group},
        "ignore": ["lm_head"], **changes,
    }  # fmt: skip


FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"quant_method": "bitsandbytes"},
            "quant_method 'bitsandbytes' is not supported; batchgen runs awq, compressed-tensors, fbgemm_fp8, fp8, gptq, mxfp4",
        ),
        (
            {**FP8, "activation_scheme": "static"},
            "(fp8): activation_scheme='static' is not supported (batchgen runs 'dynamic')",
        ),
        ({**FP8, "fmt": "e5m2"}, "(fp8): fmt='e5m2' is not supported"),
        ({**FP8, "scale_fmt": "ue8m0"}, "(fp8): scale_fmt='ue8m0' is not supported"),
        ({**FP8, "modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert"),
        ({**FP8, "weight_block_size": [32]}, "weight_block_size=[32] is not supported"),
        ({**FP8, "rounding": "stochastic"}, "(fp8) sets rounding, which batchgen does not read"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 32}, "(gptq): bits=3 is not supported"),
        (
            {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
            "(gptq): checkpoint_format='marlin' is not supported",
        ),
        ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "(gptq): lm_head=True"),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "is_marlin_format=True"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "(awq): version='gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "(awq): zero_point=False"),
        (_ct(format="nvfp4-pack-quantized"), "format 'nvfp4-pack-quantized' is not supported"),
        (_ct(weights={**W4, "num_bits": 3}), "num_bits=3 is not supported (batchgen runs 4, 8)"),
        (_ct(weights={**W4, "dynamic": True}), "weights): dynamic=True is not supported"),
        (
            _ct(input_activations={**W4, "num_bits": 8, "dynamic": False}),
            "input_activations): strategy='group' is not supported",
        ),
        (
            _ct(input_activations={"num_bits": 8, "type": "int", "strategy": "token"}),
            "input_activations): dynamic=None is not supported",
        ),
        (_ct(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme={'num_bits': 8} is not supported"),
        (_ct(quantization_status="frozen"), "quantization_status='frozen' is not supported"),
    ],
)
def test_quantization_config_refused_by_name(
    zoo_model, tmp_path: Path, config: dict, message: str
) -> None:
    assert message in config_refusal(tmp_path, zoo_model("llama"), config)


def config_refusal(tmp_path: Path, src: Path, config: dict) -> str:
    """The error reading ``src``'s config under ``config`` as its quantization_config gives
    (one line)."""
    with pytest.raises(UnsupportedModelError) as refused:
        load_model_config(_with_quantization(tmp_path, src, config))
    assert "\n" not in str(refused.value)
    return str(refused.value)


def test_plain_tensors_under_a_quantized_config_are_refused(zoo_model, tmp_path: Path) -> None:
    """A config that says fp8 over a checkpoint whose projections are plain: refused at
    load, naming the scale it lacks, never run as if quantized."""
    path = _with_quantization(tmp_path, zoo_model("llama"), FP8)
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(path, num_kv_blocks=16)
    assert "lacks tensor 'model.layers.0.self_attn.q_proj.weight_scale_inv'" in str(refused.value)


# q_proj is (64, 64); its scale is cut one row short
SHAPE_ERRORS = {
    "fp8": "torch.float32 (1, 2), not the (2, 2) fp8 holds for (64, 64) in blocks of (32, 32)",
    "fbgemm_fp8": "torch.float32 (63, 1), not the (64, 1) fbgemm_fp8 holds for 64 output channels",
    "gptq": "torch.float16 (1, 64), not the (2, 64) gptq holds for 64 inputs in groups of 32",
    "awq": "torch.float16 (1, 64), not the (2, 64) awq holds for 64 inputs in groups of 32",
    "compressed-tensors": "torch.float32 (63, 2), not the (64, 2) compressed-tensors holds for "
    "64 outputs by 2 groups of inputs",
}
SCALES = {"fp8": "weight_scale_inv", "fbgemm_fp8": "weight_scale", "gptq": "scales",
          "awq": "scales", "compressed-tensors": "weight_scale"}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SCALES))
def test_a_scale_of_another_shape_is_refused_in_one_wording(
    zoo_model, tmp_path: Path, kind: str
) -> None:
    """Every reader checks its scales' shape with the one helper (``check_shape`` in
    worker/models/quant/scheme.py): a scale one row short is refused naming the tensor,
    its dtype and shape, and the shape the layout needs and why."""
    src, out = zoo_model("llama"), tmp_path / kind
    if kind == "fp8":
        path = quantize_fp8_block(src, out, (32, 32))
    elif kind == "fbgemm_fp8":
        path = quantize_fbgemm_fp8(src, out)
    elif kind == "gptq":
        path, _ = quantize_gptq(src, out, tmp_path / "plain")
    elif kind == "compressed-tensors":
        path = compress(src, out, "w4a16")
    else:
        path, _ = quantize_awq(src, out, tmp_path / "plain")
    tensors = load_file(str(path / "model.safetensors"))
    name = f"model.layers.0.self_attn.q_proj.{SCALES[kind]}"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as refused:
        Engine.from_pretrained(path, num_kv_blocks=16)
    assert str(refused.value) == f"checkpoint {path}: tensor {name!r}: {SHAPE_ERRORS[kind]}"
