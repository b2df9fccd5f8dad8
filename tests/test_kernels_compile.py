"""The Triton kernels compile for Ampere and Hopper (ahead of time, no GPU needed).

tests/kernel_aot.py does the work in a subprocess without TRITON_INTERPRET;
see its docstring for what this catches that the interpreter cannot.

`make test` runs this file under two Triton releases: in .venv (the newest pip
gives) and in .venv-gpu-triton (the lent GPU machines' release; Makefile target
test-gpu-triton, which sets EXPECT_TRITON to it). Each test's id names the release
it compiled under, e.g. ``[triton-3.6.0]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
RELEASE = triton.__version__

SCRIPT = Path(__file__).resolve().parent / "kernel_aot.py"
# ~180 variants: about 2.5 CPU-minutes cold (Triton caches them for the next run)
pytestmark = pytest.mark.timeout(1200)


BOTH = {  # the dense model's ops: compiled for sm_80 and sm_90
    "_store_kv_kernel", "_decode_kernel", "merge_splits_kernel", "_prefill_kernel",
    "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
}  # fmt: skip
HOPPER = {  # what runs on the lent H100/H200 beyond them: sm_90 only
    "_clamped_swiglu_kernel", "_grouped_gemm_kernel", "_per_token_group_quant_kernel",
    "_w8a8_block_fp8_kernel", "_w4a16_kernel", "_latent_decode_kernel",
}  # fmt: skip


@pytest.fixture(scope="module", params=[RELEASE], ids=lambda release: f"triton-{release}")
def results() -> list[dict]:
    expected = os.environ.get("EXPECT_TRITON")
    assert expected in (None, RELEASE), f"triton {RELEASE} here, {expected} expected"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's notice
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["triton"] for r in compiled} == {RELEASE}  # the subprocess compiled under it too
    return compiled


def test_every_kernel_compiles_for_sm80_and_sm90_within_shared_memory(results):
    compiled = {(r["kernel"], r["sm"]) for r in results}
    expected = {(k, sm) for k in BOTH for sm in (80, 90)} | {(k, 90) for k in HOPPER}
    assert compiled == expected
    for r in results:
        assert r["shared_bytes"] <= r["shared_limit"], r
        # 16-byte-aligned rows load as vectors, never one 16-bit value at a time; only
        # compressed-tensors' weight_scale (N, G) is read across its rows, as it is stored
        # except a few gathers by design: the fused MoE's routing weight of each row (and
        # gpt-oss's interleaved biases), compressed-tensors' weight_scale (N, G) read across
        # its rows, the sink logit of each query head (once a program); one 16-bit operand
        # read element by element would show as >= 64
        gathers = r["kernel"] in ("_grouped_gemm_kernel", "_w4a16_kernel") or r["constexprs"].get("HAS_SINKS")  # fmt: skip
        assert r["scalar_16bit_loads"] == 0 or (gathers and r["scalar_16bit_loads"] <= 16), r
    attention = [r for r in results if r["kernel"] in ("_decode_kernel", "_prefill_kernel")]
    # half-precision dots on tensor cores (mma.sync / wgmma); fp32 ones stay exact (FMA)
    assert all(r["mma"] or r["wgmma"] for r in attention if r["dtype"] in ("bf16", "fp16"))
    assert not any(r["mma"] or r["wgmma"] for r in attention if r["dtype"] == "fp32")


def test_sm90_covers_the_gpu_checks_attention_matrix(results):
    hopper = [r for r in results if r["sm"] == 90]
    for kernel in ("_decode_kernel", "_prefill_kernel"):
        variants = {(r["dtype"], r["constexprs"]["HEAD_DIM"], r["constexprs"]["GROUP"])
                    for r in hopper if r["kernel"] == kernel}  # fmt: skip
        matrix = {(t, d, g) for t in ("fp16", "bf16") for d in (64, 128, 256) for g in (1, 4, 8)}
        assert matrix <= variants, (kernel, matrix - variants)
        for option in ("SOFTCAP", "HAS_SINKS"):
            assert {r["dtype"] for r in hopper if r["kernel"] == kernel and r["constexprs"][option]} == {"fp16", "bf16"}  # fmt: skip
    splits = {r["constexprs"]["NUM_SPLITS"] for r in hopper if r["kernel"] == "_decode_kernel"}
    assert {1, 8, 64} <= splits


def test_sm90_compiles_the_mla_decode_at_deepseek_shapes_on_tensor_cores(results):
    mla = [r for r in results if r["kernel"] == "_latent_decode_kernel"]
    assert {(r["dtype"], r["constexprs"]["MAIN_DIM"], r["constexprs"]["REST_DIM"],
             r["constexprs"]["NUM_SPLITS"]) for r in mla} == {
        (t, 512, 64, n) for t in ("fp16", "bf16") for n in (1, 8)
    }  # fmt: skip
    assert all(r["mma"] or r["wgmma"] for r in mla)


def test_sm90_compiles_the_moe_and_quantized_gemms_on_tensor_cores(results):
    hopper = [r for r in results if r["sm"] == 90]
    moe = [r for r in hopper if r["kernel"] == "_grouped_gemm_kernel"]
    assert {(r["dtype"], r["constexprs"]["MXFP4"]) for r in moe} == {
        (t, mx) for t in ("fp16", "bf16") for mx in (False, True)
    }
    # block-FP8 experts (DeepSeek-V3's shape) read as e4m3 and scales inside the same GEMMs
    assert {r["dtype"] for r in moe if r["constexprs"]["FP8_BLOCK"]} == {"fp16", "bf16"}
    fp8 = [r for r in hopper if r["kernel"] == "_w8a8_block_fp8_kernel"]
    assert {r["constexprs"]["BLOCK_M"] for r in fp8} == {16, 32, 64, 128}
    assert all(r["dtype"] == "fp8e4nv" for r in fp8)
    # Hopper's fp8 warpgroup MMA once a tile has 64 rows
    assert all(r["wgmma"] for r in fp8 if r["constexprs"]["BLOCK_M"] >= 64)
    w4 = [r for r in hopper if r["kernel"] == "_w4a16_kernel"]
    layouts = {(c["PACKED_ALONG_K"], c["AWQ_ORDER"], c["ZERO_OFFSET"], c["HAS_ZEROS"], c["HAS_G_IDX"])
               for c in (r["constexprs"] for r in w4)}  # fmt: skip
    assert layouts == {
        (True, False, 1, True, False), (True, False, 1, True, True),  # GPTQ, act-order
        (False, True, 0, True, False),  # AWQ
        (True, False, 0, False, False), (True, False, 0, True, False),  # compressed-tensors
    }  # fmt: skip
    assert all(r["mma"] or r["wgmma"] for r in moe + fp8 + w4)
