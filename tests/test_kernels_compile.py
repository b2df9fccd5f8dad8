"""The Triton kernels compile for Ampere and Hopper (ahead of time, no GPU needed).

tests/kernel_aot.py does the work in a subprocess without TRITON_INTERPRET;
see its docstring for what this catches that the interpreter cannot.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parent / "kernel_aot.py"


def test_every_kernel_compiles_for_sm80_and_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's notice
    proc = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    compiled = {(r["kernel"], r["sm"]) for r in results}
    kernels = {
        "_store_kv_kernel", "_decode_kernel", "merge_splits_kernel", "_prefill_kernel",
        "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
    }  # fmt: skip
    assert compiled == {(k, sm) for k in kernels for sm in (80, 90)}
    for r in results:
        assert r["shared_bytes"] <= r["shared_limit"], r
        # 16-byte-aligned rows load as vectors, never one bf16 at a time
        assert r["scalar_16bit_loads"] == 0, r
    attention = [r for r in results if r["kernel"] in ("_decode_kernel", "_prefill_kernel")]
    # half-precision dots on tensor cores (mma.sync / wgmma); fp32 ones stay exact (FMA)
    assert all(r["mma"] or r["wgmma"] for r in attention if r["dtype"] == "bf16")
    assert not any(r["mma"] or r["wgmma"] for r in attention if r["dtype"] == "fp32")
