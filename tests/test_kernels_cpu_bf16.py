"""The bf16 C functions of ``kernels/cpu/elementwise.c`` against ``reference.py``'s bf16
path: bit for bit where both compute in fp32 and round where the other rounds (rotary,
the K/V store, the residual add), within one bf16 step where the C code's fp32 sum of
squares or e^x is not torch's to the last bit (the norm, SiLU); and a bf16 engine that
takes them and keeps the torch path's greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchgen.kernels import reference as ref
from batchgen.kernels.cpu import elementwise as cpu_elementwise
from batchgen.kernels.cpu import native as cpu_native
from batchgen.worker.models.decoder import Decoder

BF16 = torch.bfloat16
NAMES = ("rms_norm", "fused_add_rms_norm", "apply_rotary", "silu_and_mul", "store_kv")


@pytest.fixture(autouse=True)
def _needs_the_library():
    if cpu_native.load() is None:
        pytest.skip("no C kernel on this machine")


def _reference_forbidden(monkeypatch, *names):
    for name in names:
        monkeypatch.setattr(
            cpu_elementwise.reference, name, lambda *a, **k: pytest.fail("fell back to torch")
        )


def _steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair is (same-signed finite values)."""
    assert a.dtype == b.dtype == BF16 and a.shape == b.shape
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def test_the_residual_add_rounds_as_torchs_bf16_add(monkeypatch):
    """bf16 pairs of scales 2^-20 to 2^20 apart (many sums exactly halfway between two
    bf16s: ties to even), overflow, inf - inf: the sums are torch's bf16 add's bits, but
    a NaN's (torch's vector add writes 0xffff, its .to(bfloat16) 0x7fc0, the C code
    0x7fc0)."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(3, 999, generator=gen) * 2.0 ** torch.randint(-20, 20, (3, 999), generator=gen)
    r = torch.randn(3, 999, generator=gen) * 2.0 ** torch.randint(-20, 20, (3, 999), generator=gen)
    x, r = x.to(BF16), r.to(BF16)
    x[0, :6] = torch.tensor([1.0, 1.0078125, 3.0e38, float("inf"), float("nan"), 1.0]).to(BF16)
    r[0, :6] = torch.tensor([2**-8, 2**-8, 3.0e38, float("-inf"), 1.0, -(2**-9)]).to(BF16)
    expected = x + r
    _reference_forbidden(monkeypatch, "fused_add_rms_norm")
    ones = torch.ones(999, dtype=BF16)
    _, summed = cpu_elementwise.fused_add_rms_norm(x, r, ones, 1e-6)
    assert summed.dtype == BF16
    nan = expected.isnan()
    assert nan.sum() == 2 and torch.equal(summed.isnan(), nan)
    assert torch.equal(summed.view(torch.int16)[~nan], expected.view(torch.int16)[~nan])
    assert summed[0, :3].tolist() == [1.0, 1.015625, float("inf")]  # ties to even; overflow


def test_bf16_norms_are_the_references_within_one_step(monkeypatch):
    """Rows at a stride, width 37 and 896 (a tail past the vector loops): the norm is
    bf16(w * bf16(s * inv)) like the reference's; inv's last fp32 bit may differ (sum of
    squares in another order), so an output may be one bf16 step off (measured: 12 in
    1.8M at width 896), never more; and most rows are the reference's bits."""
    gen = torch.Generator().manual_seed(22)
    for n in (37, 896):
        x = (torch.randn(41, 3 * n, generator=gen) * 3).to(BF16)[:, :n]
        residual = (torch.randn(41, n, generator=gen) * 3).to(BF16)
        w = (torch.rand(n, generator=gen) + 0.5).to(BF16)
        plain, (normed_ref, summed_ref) = (
            ref.rms_norm(x, w, 1e-6),
            ref.fused_add_rms_norm(x, residual, w, 1e-5),
        )
        with monkeypatch.context() as m:
            _reference_forbidden(m, "rms_norm", "fused_add_rms_norm")
            got = cpu_elementwise.rms_norm(x, w, 1e-6)
            normed, summed = cpu_elementwise.fused_add_rms_norm(x, residual, w, 1e-5)
        assert got.dtype == normed.dtype == summed.dtype == BF16
        assert torch.equal(summed, summed_ref)
        for c, r in ((got, plain), (normed, normed_ref)):
            steps = _steps(c, r)
            assert steps.max() <= 1 and (steps == 0).all(dim=1).sum() >= 35


def test_bf16_rotary_is_the_references_bits(monkeypatch):
    """q and k as strided views of one qkv row, head_dim 18 (a half of 9: a tail past the
    vector loops), fp32 tables: each product rounded, then the sum, then bf16 once
    (an fma would move some bits); a position past the table is refused."""
    gen = torch.Generator().manual_seed(23)
    heads, kv_heads, head_dim, tokens = 6, 2, 18, 7
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 4).to(BF16)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.arange(4096).float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    positions = torch.tensor([0, 1, 7, 4095, 30, 1000, 2047])
    expected = ref.apply_rotary(q, k, positions, cos, sin)
    _reference_forbidden(monkeypatch, "apply_rotary")
    got = cpu_elementwise.apply_rotary(q, k, positions, cos, sin)
    assert got[0].dtype == got[1].dtype == BF16
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(IndexError, match="outside the table's 4096 rows"):
        cpu_elementwise.apply_rotary(q, k, torch.tensor([0, 1, 2, 4096, 3, 4, 5]), cos, sin)


def test_bf16_silu_and_mul_is_the_references_within_one_step(monkeypatch):
    """Rows at a stride, 4863 wide (a tail past the 8s): bf16(bf16(silu(g)) * u) like the
    reference; exp8 is not Sleef's expf to the last bit, so an output may be one bf16 step
    off (measured: none in 4.8M), never more; gates past -87 (e^-g clamped, as in fp32)
    give a product under 1e-35 where torch's is 0."""
    gen = torch.Generator().manual_seed(24)
    x = (torch.randn(9, 3 * 2 * 4863, generator=gen) * 6).to(BF16)[:, : 2 * 4863]
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(BF16)
    expected = ref.silu_and_mul(x)
    _reference_forbidden(monkeypatch, "silu_and_mul")
    got = cpu_elementwise.silu_and_mul(x)
    assert got.dtype == BF16 and got.shape == (9, 4863)
    assert got[0, 0].abs() < 1e-35 and expected[0, 0] == 0
    steps = _steps(got, expected)
    steps[0, 0] = 0
    assert steps.max() <= 1 and (steps == 0).float().mean() > 0.999


def test_bf16_store_kv_writes_what_the_reference_writes(monkeypatch):
    gen = torch.Generator().manual_seed(25)
    qkv = torch.randn(4, 3, 2, 8, generator=gen).to(BF16)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([9, ref.PAD_SLOT_ID, 2, 11])
    caches = [torch.zeros(3, 4, 2, 8, dtype=BF16) for _ in range(4)]
    ref.store_kv(key, value, caches[0], caches[1], slots)
    _reference_forbidden(monkeypatch, "store_kv")
    cpu_elementwise.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    assert caches[0].count_nonzero() == 3 * 2 * 8  # three tokens written, the pad skipped
    with pytest.raises(IndexError, match="outside the cache's 12 slots"):
        cpu_elementwise.store_kv(key, value, caches[2], caches[3], torch.tensor([0, 1, 12, 3]))
    assert torch.equal(caches[2], caches[0])  # a refused step writes nothing


def test_mixed_dtypes_take_the_reference():
    """bf16 rows with an fp32 weight, bf16 rotary tables: torch's path, not the C code."""
    x = torch.randn(3, 8).to(BF16)
    w = torch.rand(8) + 0.5
    calls = []
    real = cpu_native.load()
    assert real is not None
    try:
        for name in ("add_rms_norm_bf16", "rotary_bf16"):
            object.__setattr__(real, name, lambda *a, _n=name: calls.append(_n))
        assert torch.equal(cpu_elementwise.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
        q = torch.randn(2, 2, 8).to(BF16)
        table = torch.rand(4, 4).to(BF16)
        cpu_elementwise.apply_rotary(q, q, torch.tensor([0, 1]), table, table)
    finally:
        cpu_native.load.cache_clear()
    assert calls == []


def test_a_bf16_engine_takes_the_c_functions_and_keeps_torchs_tokens_but_near_ties(
    toy_model, monkeypatch
) -> None:
    """Tiny qwen2 in bf16: every norm, rotary, SiLU and K/V store of every step is a bf16
    C call (none falls back to reference.py; per step and layer two norms and one of each
    of the others, and the final norm). With the norms kept in torch, the greedy tokens
    are the all-torch engine's (8 of 8). With the C norms too, a norm may be one bf16
    step off torch's, which moves near-ties of this random toy (measured: 2 of 8
    sequences part from the torch path's): its tokens are HF bf16's but for near-ties
    (benchmarks/bf16_agreement.py's scoring), the bar the packed projections meet."""
    from transformers import AutoModelForCausalLM

    from batchgen import Engine, SamplingParams
    from benchmarks.bf16_agreement import score
    from benchmarks.workloads import mixed

    path = toy_model("qwen2")
    prompts = mixed(8, 8192).prompts
    params = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)] * len(prompts)

    def run() -> tuple[Engine, list[list[int]]]:
        engine = Engine.from_pretrained(path, dtype="bfloat16", num_kv_blocks=128)
        return engine, [o.token_ids for o in engine.generate(prompts, params)]

    real = cpu_native.load()
    assert real is not None
    calls: dict[str, int] = {}

    def counted(name: str):
        function = getattr(real, name)

        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return function(*args)

        return call

    names = [f.name for f in dataclasses.fields(real)]
    counting = cpu_native.Native(
        **{n: counted(n) if n.endswith("_bf16") else getattr(real, n) for n in names}
    )
    with monkeypatch.context() as m:
        m.setattr(cpu_elementwise, "load", lambda: counting)
        _reference_forbidden(m, *NAMES)
        engine, native = run()
    assert isinstance(engine.runner.model, Decoder)
    layers = len(engine.runner.model.weights.layers)
    steps = calls["rotary_bf16"] // layers
    assert layers == 4 and steps >= 24 and calls["rotary_bf16"] == steps * layers
    assert calls == {
        "add_rms_norm_bf16": steps * (2 * layers + 1),
        "rotary_bf16": steps * layers,
        "silu_and_mul_bf16": steps * layers,
        "store_kv_bf16": steps * layers,
    }
    with monkeypatch.context() as m:
        m.setattr(cpu_elementwise, "load", lambda: None)  # torch's ops, as before
        _, torch_path = run()
    with monkeypatch.context() as m:
        m.setattr(cpu_elementwise, "_native_for", lambda *a: None)  # the norms' only way in
        _, torch_norms = run()
    assert torch_norms == torch_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=BF16, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        now = score(hf, prompts, native, tie=0.125)
    print(f"C path: {now}, {sum(a == b for a, b in zip(native, torch_path))} of 8 as torch's")
    assert now["positions"] == 8 * 24 and now["agreement"] >= 0.9
    assert now["near_ties"] == now["differences"] and now["largest_gap"] <= 0.125
