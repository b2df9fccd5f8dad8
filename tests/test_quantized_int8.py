"""W8A8 int8 on the CPU: int8 activations times int8 weights in int32 (``torch._int_mm``).

The integer product replaces dequantize-then-matmul for int8 weights with a scale
per channel or per tensor under dynamic per-token int8 activations; it must give
the dequantizing product's outputs up to fp32 rounding, and the same greedy tokens.
Every other scheme keeps the dequantizing product.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from batchgen import Engine, SamplingParams
from batchgen.worker.models.quant import QuantizedLinear
from batchgen.worker.models.quant.compressed_tensors import (
    ActivationArgs,
    CompressedWeight,
    WeightArgs,
)
from batchgen.worker.models.weights import linear
from tests.family_parity import engine_prompt_logits, random_prompts
from tests.model_zoo import VOCAB
from tests.quant_checkpoints import compress

INT8 = ActivationArgs("int")
PER_CHANNEL = WeightArgs("int", 8, True, None)


def _int8_weight(n: int, k: int, per_tensor: bool, seed: int) -> CompressedWeight:
    torch.manual_seed(seed)
    values = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(1) * 0.02 if per_tensor else torch.rand(n, 1) * 0.02
    return CompressedWeight(values, scale, None, PER_CHANNEL, (n, k), False)


def _layer(parts: tuple[CompressedWeight, ...], bias: torch.Tensor | None) -> QuantizedLinear:
    out = sum(p.out_features for p in parts)
    k = parts[0].in_features
    return QuantizedLinear(
        torch.empty(k, out, device="meta"), bias, decided=True, parts=parts, quantize_input=INT8
    )


@pytest.mark.parametrize("per_tensor", [False, True])
def test_int8_product_equals_dequantize_then_matmul(per_tensor: bool) -> None:
    """Fused parts of odd widths, a bias, 0 to 33 rows, fp32 and bf16 inputs."""
    parts = (_int8_weight(48, 72, per_tensor, 0), _int8_weight(37, 72, per_tensor, 1))
    bias = torch.randn(85)
    layer = _layer(parts, bias)
    # the integer path is chosen, over the stored int8 weights themselves (no copy)
    assert layer.int8 is not None
    assert [w.data_ptr() for w, _ in layer.int8] == [p.values.data_ptr() for p in parts]
    whole = layer.dequantized()
    for rows in (0, 1, 5, 33):
        x = torch.randn(rows, 72) * 3
        expected = linear(INT8(x), whole, bias)
        # integer sums are exact, so only the final scaling's fp32 rounding and the
        # dequantizing product's own differ: measured at most 5.0e-7 of the largest
        # output (40 layers of these shapes and seeds)
        tolerance = 2e-6 * float(expected.abs().max()) if rows else 0.0
        torch.testing.assert_close(layer(x), expected, rtol=0, atol=tolerance)
    x = torch.randn(5, 72, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    # bf16: the same int8 inputs and bf16 token scales, the product scaled in fp32 and
    # rounded once to bf16 (the dequantizing path rounds q x scale to bf16 first)
    q, scale = INT8.quantize(x)
    expected = linear(q.float() * scale.float(), whole, bias)
    torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-6)


def test_other_schemes_keep_the_dequantizing_product() -> None:
    int8 = _int8_weight(16, 32, False, 0)
    assert _layer((int8,), None).int8 is not None
    # int8 weights without int8 activations (W8A16), or with FP8 activations
    for act in (None, ActivationArgs("float")):
        plain = QuantizedLinear(
            torch.empty(32, 16, device="meta"), None, decided=True, parts=(int8,),
            quantize_input=act,
        )  # fmt: skip
        assert plain.int8 is None
    # grouped scales
    grouped = CompressedWeight(int8.values, torch.rand(16, 2), None,
                               WeightArgs("int", 8, True, 16), (16, 32), False)  # fmt: skip
    assert _layer((grouped,), None).int8 is None


def test_w8a8_checkpoint_runs_int8_with_the_dequantizing_tokens(zoo_model, tmp_path: Path) -> None:
    """The compressed-tensors library's W8A8 checkpoint: every decoder projection runs the
    integer product; its logits against the same engine with the dequantizing product."""
    path = compress(zoo_model("llama"), tmp_path / "w8a8", "w8a8-int8")
    engine = Engine.from_pretrained(
        path, num_kv_blocks=64, max_num_batched_tokens=24, enable_prefix_caching=False
    )
    layers = engine.runner.model.weights.layers  # type: ignore[attr-defined]
    projections = [
        p for x in layers for p in (x.attention.qkv, x.attention.o, x.mlp.up, x.mlp.down)
    ]  # fmt: skip
    assert len(projections) == 8
    assert all(isinstance(p, QuantizedLinear) and p.int8 is not None for p in projections)
    torch.manual_seed(0)
    for p in projections:  # each projection of the checkpoint, as the unit test above
        x = torch.randn(9, p.weight.shape[0])
        expected = linear(INT8(x), p.dequantized(), p.bias)
        tolerance = 2e-6 * float(expected.abs().max())
        torch.testing.assert_close(p(x), expected, rtol=0, atol=tolerance)
    (tokens,) = random_prompts(VOCAB, (70,), seed=11)
    prompts = random_prompts(VOCAB, (1, 6, 17, 40), seed=12)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    logits, _ = engine_prompt_logits(engine, tokens)
    greedy = [o.token_ids for o in engine.generate(prompts, params)]
    for p in projections:
        p.int8 = None  # the dequantizing product, on the same weights
    dequantizing, _ = engine_prompt_logits(engine, tokens)
    off = (logits - dequantizing).abs().amax(dim=-1)
    print(f"logits: {int((off > 1e-4).sum())} of {len(off)} rows off by more than 1e-4, "
          f"at most {float(off.max()):.2e}")  # fmt: skip
    # end to end, a last-bit difference in one layer moves the next layer's per-token
    # int8 input where compressed-tensors' amax / 127.5 scale puts a negative extreme on
    # the -127.5 rounding boundary (-128 or -127): measured 0.098 at most, the same
    # bound as against transformers (tests/test_quantized_models.py); tokens equal
    torch.testing.assert_close(logits, dequantizing, rtol=0, atol=0.15)
    assert [o.token_ids for o in engine.generate(prompts, params)] == greedy
    assert len({tuple(g) for g in greedy}) > 1
