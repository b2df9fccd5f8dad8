"""The CPU path's C functions, compiled at first use.

- paged decode attention: torch can only attend over paged K/V by first
  gathering each sequence's blocks into a dense copy (every layer, every
  step) and reading the copy again; this reads K and V once, straight from
  the blocks the table names (with a sliding window, only the window's): the
  scores of all query heads of a position (GQA: head h reads KV head h // group),
  a softmax per head (with its sink's column when there are sinks, gpt-oss), the weighted
  sum of V. When a step has enough K/V to read, its rows are taken one at a
  time by the calling thread and up to torch's thread count - 1 helpers, from
  a pool that lives as long as the process and sleeps between calls (threads
  started per call cost ~30 us each, and on a busy machine wait to be
  scheduled); a row is done by one thread, so results do not depend on the
  thread count, and a helper not yet scheduled takes no row and is not waited for;
- RMSNorm with an optional residual add, neox rotary, SiLU-and-multiply and
  the K/V store into their cache slots: one pass each where torch takes two
  to twelve small ops, whose dispatch, not their arithmetic, is what they
  cost at decode batch sizes.

fp32 throughout; the callers (``cpu_decode.py``, ``cpu_elementwise.py``)
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

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* q (S, H, D) with row/head strides, unit stride in D; k/v caches contiguous
   (num_blocks, BS, HK, D); tables (S, >= ceil(ctx / BS)) int32 rows; lens (S,)
   int32; out (S, H, D) contiguous. */
typedef struct {
    const float *q; int64_t q_stride_s, q_stride_h;
    const float *k_cache, *v_cache;
    const int32_t *tables; int64_t table_stride; const int32_t *lens;
    float *out; int64_t S, H, HK, D, BS; float scale; int64_t max_len;
    int64_t window; float softcap; /* 0: no sliding window, no soft-capping */
    const float *sinks; /* (H,) per-head sink logits, or NULL */
} Decode;

/* One row s; scores: H * max_len + H floats of scratch. */
static void decode_row(const Decode *a, int64_t s, float *scores)
{
    const int64_t H = a->H, D = a->D, BS = a->BS, group = H / a->HK;
    const int64_t row = a->HK * D; /* floats from one position to the next */
    float *top = scores + H * a->max_len;
    const int64_t n = a->lens[s];
    const int32_t *table = a->tables + s * a->table_stride;
    const float *qs = a->q + s * a->q_stride_s;
    float *o = a->out + s * H * D;
    for (int64_t i = 0; i < H * D; i++) o[i] = 0.f;
    if (n == 0) return; /* a padding row attends to nothing: zeros */
    /* the query sits at n - 1 and, with a window, sees keys n - window .. n - 1 */
    const int64_t lo = (a->window > 0 && n > a->window) ? n - a->window : 0;
    for (int64_t h = 0; h < H; h++) top[h] = -INFINITY;
    for (int64_t p = lo; p < n; p++) { /* scores: K read once, every head of a position together */
        const float *k = a->k_cache + ((int64_t)table[p / BS] * BS + p % BS) * row;
        for (int64_t h = 0; h < H; h++) {
            const float *qh = qs + h * a->q_stride_h, *kh = k + (h / group) * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; d++) dot += qh[d] * kh[d];
            dot *= a->scale;
            if (a->softcap > 0.f) dot = a->softcap * tanhf(dot / a->softcap);
            scores[h * n + p] = dot;
            if (dot > top[h]) top[h] = dot;
        }
    }
    for (int64_t h = 0; h < H; h++) { /* softmax per head, with its sink's column */
        float sum = 0.f, *sh = scores + h * n;
        if (a->sinks && a->sinks[h] > top[h]) top[h] = a->sinks[h];
        for (int64_t p = lo; p < n; p++) { sh[p] = expf(sh[p] - top[h]); sum += sh[p]; }
        if (a->sinks) sum += expf(a->sinks[h] - top[h]);
        const float inv = 1.f / sum;
        for (int64_t p = lo; p < n; p++) sh[p] *= inv;
    }
    for (int64_t p = lo; p < n; p++) { /* weighted sum: V read once */
        const float *v = a->v_cache + ((int64_t)table[p / BS] * BS + p % BS) * row;
        for (int64_t h = 0; h < H; h++) {
            const float w = scores[h * n + p], *vh = v + (h / group) * D;
            float *oh = o + h * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) oh[d] += w * vh[d];
        }
    }
}

/* A pool of helper threads that lives as long as the process, started as calls ask
   for them. A call publishes its rows as job number `generation`; the caller and the
   helpers it woke take rows one at a time from `ticket` (generation << 32 | next row),
   so a helper the scheduler has not run yet takes none and is never waited for: the
   caller waits only for rows taken and not yet done. A row is done by one thread
   whatever the thread count, so results do not depend on it. Helpers sleep on a
   condition variable between jobs (no spinning against other work). */
enum { MAX_HELPERS = 63 };
static struct {
    pthread_mutex_t lock; /* guards generation, helpers, started; the waits */
    pthread_cond_t wake, finished;
    uint32_t generation;
    int64_t helpers; /* helpers the current job wants */
    int64_t started;
    Decode job; /* the current job, as the caller published it under the lock */
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
    _Atomic int status; /* 1 once a thread found no memory for its scores */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER,
            .finished = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER; /* one job at a time */
static pthread_once_t fork_handler = PTHREAD_ONCE_INIT;

/* Takes and does rows of job `generation` (`job`, as it was when it was published)
   until none is left. A row taken below S is not done yet, so the job, and what its
   pointers point at, are still there. */
static void take_rows(const Decode *job, uint32_t generation)
{
    float *scores = NULL;
    uint64_t ticket = atomic_load(&pool.ticket);
    while ((uint32_t)(ticket >> 32) == generation && (int64_t)(ticket & 0xffffffffu) < job->S) {
        if (!atomic_compare_exchange_weak(&pool.ticket, &ticket, ticket + 1)) continue;
        if (!scores)
            scores = malloc(sizeof(float) * (size_t)(job->H * (job->max_len > 0 ? job->max_len : 1) + job->H));
        if (scores) decode_row(job, (int64_t)(ticket & 0xffffffffu), scores);
        else atomic_store(&pool.status, 1);
        if (atomic_fetch_add(&pool.done, 1) + 1 == job->S) { /* the caller may be waiting */
            pthread_mutex_lock(&pool.lock);
            pthread_cond_signal(&pool.finished);
            pthread_mutex_unlock(&pool.lock);
        }
        ticket = atomic_load(&pool.ticket);
    }
    free(scores);
}

static void *helper(void *arg)
{
    const int64_t index = (int64_t)(intptr_t)arg;
    uint32_t seen = 0; /* no job has generation 0 */
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (index >= pool.helpers) continue;
        const Decode job = pool.job;
        pthread_mutex_unlock(&pool.lock);
        take_rows(&job, seen);
        pthread_mutex_lock(&pool.lock);
    }
    return NULL;
}

/* A forked child has none of the helpers (nor, maybe, an unlocked lock): starts afresh. */
static void forget_pool(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pthread_mutex_init(&caller, NULL);
    pool.started = 0;
}

static void watch_forks(void) { pthread_atfork(NULL, NULL, forget_pool); }

/* Rows of the step over this thread and up to threads - 1 helpers. Returns 0,
   or 1 when out of memory. */
int paged_decode_attention_f32(
    const float *q, int64_t q_stride_s, int64_t q_stride_h,
    const float *k_cache, const float *v_cache,
    const int32_t *tables, int64_t table_stride, const int32_t *lens,
    float *out, int64_t S, int64_t H, int64_t HK, int64_t D, int64_t BS,
    float scale, int64_t max_len, int64_t window, float softcap, const float *sinks,
    int64_t threads)
{
    const Decode job = {q, q_stride_s, q_stride_h, k_cache, v_cache, tables, table_stride,
                        lens, out, S, H, HK, D, BS, scale, max_len, window, softcap, sinks};
    int64_t helpers = threads - 1 < S - 1 ? threads - 1 : S - 1;
    if (helpers > MAX_HELPERS) helpers = MAX_HELPERS;
    if (helpers < 1 || S >= 0xffffffffLL || pthread_mutex_trylock(&caller) != 0) {
        /* alone: one thread asked, one row, or another thread's job holds the pool */
        float *scores = malloc(sizeof(float) * (size_t)(H * (max_len > 0 ? max_len : 1) + H));
        if (!scores) return 1;
        for (int64_t s = 0; s < S; s++) decode_row(&job, s, scores);
        free(scores);
        return 0;
    }
    pthread_once(&fork_handler, watch_forks);
    pthread_mutex_lock(&pool.lock);
    while (pool.started < helpers) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int failed = pthread_create(&id, &attr, helper, (void *)(intptr_t)pool.started);
        pthread_attr_destroy(&attr);
        if (failed) break; /* fewer helpers: the rows are taken by those there are */
        pool.started++;
    }
    pool.job = job;
    atomic_store(&pool.done, 0);
    atomic_store(&pool.status, 0);
    if (++pool.generation == 0) pool.generation = 1;
    const uint32_t generation = pool.generation;
    pool.helpers = helpers;
    atomic_store(&pool.ticket, (uint64_t)generation << 32);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    take_rows(&job, generation);
    pthread_mutex_lock(&pool.lock);
    while (atomic_load(&pool.done) < S) pthread_cond_wait(&pool.finished, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    const int status = atomic_load(&pool.status);
    pthread_mutex_unlock(&caller);
    return status;
}

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
   x rows at x_stride, out (T, N) contiguous. e^-g eight at a time: -g = k ln2 + r,
   |r| <= ln2 / 2, e^r by Cephes' expf polynomial (within 2 ulp), 2^k in the exponent
   bits; -g is clamped to [-87, 88], where e^-g is 0 or inf to a float anyway. */
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
