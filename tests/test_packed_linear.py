"""CPU fp32 and bf16 projections are packed for oneDNN at their first call
(worker/models/weights.py)."""

from __future__ import annotations

import pytest
import torch

from batchgen.worker.models import weights
from batchgen.worker.models.decoder import Decoder
from batchgen.worker.models.layers.mlp import DenseMlp
from batchgen.worker.models.layers.self_attention import SelfAttention
from batchgen.worker.models.weights import PACK_MIN, Linear, fuse, packable

BF16 = torch.bfloat16
# Where packing is expected, from torch and the CPU, not from packable(): a packable() that
# turned a dtype down would otherwise skip its tests rather than fail them
ONEDNN = torch.backends.mkldnn.is_available()
NATIVE_BF16 = ONEDNN and torch.cpu._is_avx512_bf16_supported()
DTYPES = [
    pytest.param(torch.float32, marks=pytest.mark.skipif(not ONEDNN, reason="no oneDNN"),
                 id="float32"),
    pytest.param(BF16, marks=pytest.mark.skipif(not NATIVE_BF16, reason="no AVX512-BF16"),
                 id="bfloat16"),
]  # fmt: skip


def test_bf16_is_packed_where_the_cpu_multiplies_bf16_itself() -> None:
    assert packable(torch.zeros(128, 128, dtype=BF16)) == NATIVE_BF16
    assert packable(torch.zeros(256, 512)) == ONEDNN


def _linear(
    rows_in: int = 256, out: int = 520, bias: bool = True, dtype: torch.dtype = torch.float32
) -> tuple[Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out, rows_in, generator=g).to(dtype)  # HF's (out, in)
    b = torch.randn(out, generator=g).to(dtype) if bias else None
    return fuse([weight], [b]), weight


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES[:1])
def test_packed_product_equals_torch_and_drops_the_dense_copy(bias: bool, dtype) -> None:
    layer, weight = _linear(bias=bias)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.linear(x, weight, layer.bias)
    out = layer(x)
    assert layer.packed is not None and layer.weight.is_meta
    assert layer.weight.shape == (256, 520) and layer.out_features == 520
    # outputs ~16 in size (256 products of unit normals): fp32 sums in another order
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer(x), out)  # again, from the packed copy


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_packed_bf16_product_is_the_fp32_sum_rounded_once(bias: bool, dtype) -> None:
    layer, weight = _linear(bias=bias, dtype=dtype)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    unpacked = weights.linear(x, layer.weight, layer.bias)  # torch.mm / addmm, as before
    out = layer(x)
    assert layer.packed is not None and layer.weight.is_meta and layer.weight.dtype == dtype
    assert out.dtype == dtype and torch.equal(layer(x), out)
    # The exact sum of the bf16 values (a bf16 x bf16 product is exact in fp32). Summed in fp32
    # (256 products and the bias) it is off by at most E = 257 * 2^-24 * sum |terms|, and one
    # rounding to bf16 (8 significant bits) adds at most 2^-8 of the value: |out - exact| <=
    # 2^-8 (|exact| + E) + E. Measured: up to 0.94 of that, and bit for bit torch.mm's here.
    terms = x.double().abs() @ weight.double().abs().t()
    exact = x.double() @ weight.double().t()
    if layer.bias is not None:
        b = layer.bias.double()
        exact, terms = exact + b, terms + b.abs()
    fp32_error = 257 * 2.0**-24 * terms
    bound = 2.0**-8 * (exact.abs() + fp32_error) + fp32_error
    assert bool(((out.double() - exact).abs() <= bound).all())
    # so the packed and unpacked products are each other's within two such roundings
    assert bool(((out.double() - unpacked.double()).abs() <= 2 * bound).all())
    # and bf16 sums (a rounding per term) would not be: the bound is tight enough to tell
    naive = torch.zeros(9, 520, dtype=dtype)
    for k in range(256):
        naive += x[:, k : k + 1] * weight[:, k]
    assert not bool(((naive.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_other_rows_or_the_threads(dtype) -> None:
    layer, _ = _linear(dtype=dtype)
    x = torch.randn(64, 256).to(dtype)
    full = layer(x)
    assert layer.packed is not None
    for rows in (1, 3, 16, 17, 63):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    assert torch.equal(layer(x[::3]), full[::3])  # rows at a stride
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(layer(x), full), n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_packing_where_onednn_is_off_or_the_weight_is_small_or_fp16(dtype) -> None:
    layer, weight = _linear(dtype=dtype)
    with torch.backends.mkldnn.flags(enabled=False):
        out = layer(torch.randn(4, 256).to(dtype))
    assert layer.packed is None and not layer.weight.is_meta and out.shape == (4, 520)
    half = Linear(weight.t().contiguous().to(torch.float16))
    half(torch.randn(2, 256, dtype=torch.float16))
    assert half.packed is None and half.weight.dtype == torch.float16
    assert not packable(torch.zeros(256, 512, dtype=dtype, device="meta"))
    # below the size worth packing, and at it
    small = Linear(torch.randn(256, PACK_MIN[dtype] // 256 - 1).to(dtype))
    small(torch.randn(3, 256).to(dtype))
    assert small.packed is None and not small.weight.is_meta
    assert packable(torch.zeros(256, PACK_MIN[dtype] // 256, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_input_gives_empty_output(dtype) -> None:
    layer, _ = _linear(dtype=dtype)
    assert layer(torch.randn(0, 256).to(dtype)).shape == (0, 520)
    assert layer.packed is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_where_onednn_refuses_to_pack_every_projection_stays_with_torch_mm(monkeypatch, dtype):
    def refuse(*args: object) -> None:
        raise RuntimeError("no primitive for this CPU")

    monkeypatch.setattr(weights, "_refused", [])
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer, _ = _linear(dtype=dtype)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert layer.bias is not None
    assert torch.equal(layer(x), torch.addmm(layer.bias, x, layer.weight))  # the torch.mm path
    assert layer.packed is None and not layer.weight.is_meta
    assert weights._refused == ["no primitive for this CPU"]
    assert not packable(torch.zeros(256, 512))  # the next projection does not try again
    assert not packable(torch.zeros(256, 512, dtype=BF16))


@pytest.mark.parametrize("dtype", DTYPES[1:])
def test_a_bf16_engine_packs_its_projections_and_keeps_hf_bf16s_tokens(
    toy_model, monkeypatch, dtype
) -> None:
    """Every projection of a tiny bf16 engine is packed (this fails when packing is silently
    skipped), and its greedy tokens are those of torch.mm's products and HF bf16's but for
    near-ties (benchmarks/bf16_agreement.py's scoring: HF's choice at every position given
    the engine's own prefix)."""
    from transformers import AutoModelForCausalLM

    from batchgen import Engine, SamplingParams
    from benchmarks.bf16_agreement import score
    from benchmarks.workloads import mixed

    path = toy_model("qwen2")  # q/k/v biases: the packed product's bias too
    prompts = mixed(8, 8192).prompts
    params = [SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0)] * len(prompts)

    def run() -> tuple[Engine, list[list[int]]]:
        engine = Engine.from_pretrained(path, dtype="bfloat16", num_kv_blocks=128)
        return engine, [o.token_ids for o in engine.generate(prompts, params)]

    engine, packed = run()
    assert isinstance(engine.runner.model, Decoder)
    w = engine.runner.model.weights
    linears = [w.lm_head]
    for x in w.layers:
        assert isinstance(x.mlp, DenseMlp) and isinstance(x.attention, SelfAttention)
        linears += [x.attention.qkv, x.attention.o, x.mlp.up, x.mlp.down]
    # tiny qwen2's 4 layers of q/k/v 256 x 512, o 256 x 256, gate/up 256 x 2048, down
    # 1024 x 256, and the LM head 256 x 8192: all at least PACK_MIN (fp32 keeps o with torch.mm)
    assert len(linears) == 17 and min(x.weight.numel() for x in linears) >= PACK_MIN[dtype]
    assert all(
        x.packed is not None and x.weight.is_meta and x.weight.dtype == dtype for x in linears
    )
    with monkeypatch.context() as m:
        m.setattr(weights, "packable", lambda weight: False)  # torch.mm, as before
        unpacked_engine, unpacked = run()
    assert isinstance(unpacked_engine.runner.model, Decoder)
    assert unpacked_engine.runner.model.weights.lm_head.packed is None
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        now = score(hf, prompts, packed, tie=0.125)
    print(f"packed: {now}")
    # the same tokens as torch.mm's (both sum in fp32 and round once; measured: 8 of 8 equal)
    assert packed == unpacked
    # HF bf16's but for near-ties (measured: 96.5%, 9 near-ties of gap <= 0.031)
    assert now["positions"] == 256 and now["agreement"] >= 0.9
    assert now["near_ties"] == now["differences"] and now["largest_gap"] <= 0.125
