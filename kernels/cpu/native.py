"""The CPU path's C functions, compiled at first use.

- paged decode attention over its pool of threads: ``decode_source.py``;
- RMSNorm with an optional residual add, neox rotary, SiLU-and-multiply and
  the K/V store into their cache slots (here): one pass each where torch
  takes two to twelve small ops, whose dispatch, not their arithmetic, is
  what they cost at decode batch sizes;
- ``exp8``, e^x eight floats at a time, which the attention's softmax and
  SiLU share (``VECTOR_SOURCE``, compiled ahead of both).

fp32 throughout; the callers (``decode_native.py``, ``elementwise.py``)
check what the C code trusts. The library is compiled once per process with
the machine's C compiler (``$CC``, else cc, gcc or clang; well under a
second) and called through ctypes, which releases the GIL. Where there is no
compiler, or the build fails, ``load()`` returns None and the callers keep
to torch.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.kernels.cpu.decode_source import DECODE_SOURCE

log = logging.getLogger(__name__)

_INCLUDES = """
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
"""

# Eight floats at a time, for the decode attention's softmax and SiLU alike.
VECTOR_SOURCE = r"""
/* e^x eight at a time: x = k ln2 + r, |r| <= ln2 / 2, e^r by Cephes' expf polynomial
   (within 2 ulp), 2^k in the exponent bits; x is clamped to [-87, 88], where e^x is 0
   or inf to a float anyway. */
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 exp8(v8 x)
{
    const v8 lo = {-87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f, -87.f};
    const v8 hi = {88.f, 88.f, 88.f, 88.f, 88.f, 88.f, 88.f, 88.f};
    x = (v8)(((i8)x & ~(i8)(x < lo)) | ((i8)lo & (i8)(x < lo)));
    x = (v8)(((i8)x & ~(i8)(x > hi)) | ((i8)hi & (i8)(x > hi)));
    const float round = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer */
    const v8 k = (x * 1.44269504088896341f + round) - round;
    v8 r = x - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    v8 p = 1.9875691500E-4f * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.f;
    const i8 two_k = (__builtin_convertvector(k, i8) + 127) << 23;
    return p * (v8)two_k;
}
"""

ELEMENTWISE_SOURCE = r"""
/* out[t] = s * w / sqrt(mean(s^2) + eps) with s = x[t] (+ res[t], also written to
   res_out[t]); x and res rows at their strides, out and res_out (T, N) contiguous. */
void add_rms_norm_f32(
    const float *x, int64_t x_stride, const float *res, int64_t res_stride,
    const float *w, float *out, float *res_out, int64_t T, int64_t N, float eps)
{
    for (int64_t t = 0; t < T; t++) {
        const float *s = x + t * x_stride;
        if (res) {
            const float *r = res + t * res_stride;
            float *sum = res_out + t * N;
            #pragma omp simd
            for (int64_t i = 0; i < N; i++) sum[i] = s[i] + r[i];
            s = sum;
        }
        float squares = 0.f;
        #pragma omp simd reduction(+:squares)
        for (int64_t i = 0; i < N; i++) squares += s[i] * s[i];
        const float inv = 1.f / sqrtf(squares / (float)N + eps);
        float *o = out + t * N;
        #pragma omp simd
        for (int64_t i = 0; i < N; i++) o[i] = s[i] * inv * w[i];
    }
}

/* Neox rotary: each head's halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) at its
   token's position. q (T, H, D) and k (T, HK, D) at their row/head strides; cos, sin
   (P, D / 2); out (T, H + HK, D) contiguous, q's heads then k's. Returns 1 when a
   position is outside [0, P). */
int rotary_f32(
    const float *q, int64_t q_stride_t, int64_t q_stride_h,
    const float *k, int64_t k_stride_t, int64_t k_stride_h,
    const int64_t *positions, const float *cos, const float *sin, int64_t P,
    float *out, int64_t T, int64_t H, int64_t HK, int64_t D)
{
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= P) return 1;
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        for (int64_t h = 0; h < H + HK; h++) {
            const float *x = h < H ? q + t * q_stride_t + h * q_stride_h
                                   : k + t * k_stride_t + (h - H) * k_stride_h;
            float *o = out + (t * (H + HK) + h) * D;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                o[i] = x1 * c[i] - x2 * s[i];
                o[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return 0;
}

/* out[t, i] = silu(g) * u with g = x[t, i], u = x[t, N + i], silu(g) = g / (1 + e^-g);
   x rows at x_stride, out (T, N) contiguous; e^-g eight at a time (exp8). */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t N)
{
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * x_stride, *u = g + N;
        float *o = out + t * N;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) {
            v8 gv, uv;
            memcpy(&gv, g + i, sizeof gv);
            memcpy(&uv, u + i, sizeof uv);
            const v8 ov = gv / (1.f + exp8(-gv)) * uv;
            memcpy(o + i, &ov, sizeof ov);
        }
        for (; i < N; i++) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* k_cache[slot[t]] = key[t], v_cache[slot[t]] = value[t]: caches contiguous (num_slots,
   HK, D); key/value rows at their token/head strides, unit stride in D; a slot of -1
   (padding) is skipped. Returns 1, having written nothing, when a slot is outside
   [-1, num_slots). */
int store_kv_f32(
    const float *key, int64_t k_stride_t, int64_t k_stride_h,
    const float *value, int64_t v_stride_t, int64_t v_stride_h,
    float *k_cache, float *v_cache, const int64_t *slots, int64_t T, int64_t HK, int64_t D,
    int64_t num_slots)
{
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return 1;
    const size_t bytes = sizeof(float) * (size_t)D;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        float *kc = k_cache + slots[t] * HK * D, *vc = v_cache + slots[t] * HK * D;
        for (int64_t h = 0; h < HK; h++) {
            memcpy(kc + h * D, key + t * k_stride_t + h * k_stride_h, bytes);
            memcpy(vc + h * D, value + t * v_stride_t + h * v_stride_h, bytes);
        }
    }
    return 0;
}
"""

SOURCE = _INCLUDES + VECTOR_SOURCE + DECODE_SOURCE + ELEMENTWISE_SOURCE

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
# name -> (argument types, return type)
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "paged_decode_attention_f32": (
        [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
         _F32, _I64, _I64, _F32, _PTR, _I64], ctypes.c_int,
    ),
    "add_rms_norm_f32": ([_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _F32], None),
    "rotary_f32": (
        [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64],
        ctypes.c_int,
    ),
    "silu_and_mul_f32": ([_PTR, _I64, _PTR, _I64, _I64], None),
    "store_kv_f32": (
        [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64],
        ctypes.c_int,
    ),
}  # fmt: skip
# -march=native where the compiler knows it; -fopenmp-simd vectorises the
# reductions without OpenMP's runtime (torch has its own thread pool).
_FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp-simd"],
    ["-O3", "-fopenmp-simd"],
    ["-O2"],
)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


@dataclass(frozen=True, slots=True)
class Native:
    """The compiled functions, called as ``native.paged_decode_attention_f32(...)``."""

    paged_decode_attention_f32: Any
    add_rms_norm_f32: Any
    rotary_f32: Any
    silu_and_mul_f32: Any
    store_kv_f32: Any


@functools.cache
def load() -> Native | None:
    """The compiled library, or None (no compiler, or it failed: said once in the log)."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found ($CC, cc, gcc, clang): the CPU path uses torch only")
        return None
    with tempfile.TemporaryDirectory(prefix="batchgen-kernel-") as tmp:
        source, library = Path(tmp, "cpu_native.c"), Path(tmp, "cpu_native.so")
        source.write_text(SOURCE)
        errors = ""
        for flags in _FLAG_SETS:
            cmd = [
                cc,
                *flags,
                "-shared",
                "-fPIC",
                str(source),
                "-o",
                str(library),
                "-lm",
                "-pthread",
            ]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.TimeoutExpired) as exc:
                errors = repr(exc)
                continue
            if proc.returncode == 0:
                break
            errors = proc.stderr.strip()[-500:]
        else:
            log.warning("compiling the CPU path's C functions failed (%s); using torch", errors)
            return None
        handle = ctypes.CDLL(str(library))  # stays loaded after the file is gone
    functions = {}
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(handle, name)
        function.argtypes, function.restype = argtypes, restype
        functions[name] = function
    return Native(**functions)
