/* RMSNorm with an optional residual add, neox rotary, SiLU-and-multiply and the K/V
   store into their cache slots: one pass each where torch takes two to twelve small ops,
   whose dispatch, not their arithmetic, is what they cost at decode batch sizes. Each in
   fp32 and in bf16 (_bf16: bf16 tensors, but for rotary's fp32 cos/sin, computed in fp32
   and rounded to bf16 where reference.py's bf16 path rounds). Called from elementwise.py,
   which checks what the C code trusts. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* GCC contracts a * b - c * d into an fma unless told not to (clang does not across
   statements): the bf16 rotary rounds each product, as torch's ops do. */
#if defined(__GNUC__) && !defined(__clang__)
#define NO_FMA __attribute__((optimize("fp-contract=off")))
#else
#define NO_FMA
#endif

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

/* k_cache[slot[t]] = key[t], v_cache[slot[t]] = value[t], elements of `size` bytes:
   caches contiguous (num_slots, HK, D); key/value rows at their token/head strides (in
   elements), unit stride in D; a slot of -1 (padding) is skipped. Returns 1, having
   written nothing, when a slot is outside [-1, num_slots). */
static int store_kv(
    const char *key, int64_t k_stride_t, int64_t k_stride_h,
    const char *value, int64_t v_stride_t, int64_t v_stride_h,
    char *k_cache, char *v_cache, const int64_t *slots, int64_t T, int64_t HK, int64_t D,
    int64_t num_slots, size_t size)
{
    for (int64_t t = 0; t < T; t++)
        if (slots[t] < -1 || slots[t] >= num_slots) return 1;
    const size_t bytes = size * (size_t)D;
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        char *kc = k_cache + slots[t] * HK * bytes, *vc = v_cache + slots[t] * HK * bytes;
        for (int64_t h = 0; h < HK; h++) {
            memcpy(kc + h * bytes, key + (t * k_stride_t + h * k_stride_h) * size, bytes);
            memcpy(vc + h * bytes, value + (t * v_stride_t + h * v_stride_h) * size, bytes);
        }
    }
    return 0;
}

int store_kv_f32(
    const float *key, int64_t k_stride_t, int64_t k_stride_h,
    const float *value, int64_t v_stride_t, int64_t v_stride_h,
    float *k_cache, float *v_cache, const int64_t *slots, int64_t T, int64_t HK, int64_t D,
    int64_t num_slots)
{
    return store_kv((const char *)key, k_stride_t, k_stride_h, (const char *)value,
                    v_stride_t, v_stride_h, (char *)k_cache, (char *)v_cache, slots, T, HK, D,
                    num_slots, sizeof(float));
}

/* store_kv_f32 for bf16 key/value/caches: the same bytes moved, two per element. */
int store_kv_bf16(
    const bf16_t *key, int64_t k_stride_t, int64_t k_stride_h,
    const bf16_t *value, int64_t v_stride_t, int64_t v_stride_h,
    bf16_t *k_cache, bf16_t *v_cache, const int64_t *slots, int64_t T, int64_t HK, int64_t D,
    int64_t num_slots)
{
    return store_kv((const char *)key, k_stride_t, k_stride_h, (const char *)value,
                    v_stride_t, v_stride_h, (char *)k_cache, (char *)v_cache, slots, T, HK, D,
                    num_slots, sizeof(bf16_t));
}

/* add_rms_norm_f32 for bf16 x, res, w, out and res_out, as reference.py's bf16 path:
   s = bf16(x + res) (the sum torch's bf16 add writes), out = bf16(w * bf16(s * inv))
   with inv = 1 / sqrt(mean(s^2) + eps) in fp32. The squares are added in another order
   than torch's sum, so inv may differ from torch's in its last bit, and an output by
   one bf16 step where that moves a rounding (about 1 in 10^5); all else is bit for bit. */
void add_rms_norm_bf16(
    const bf16_t *x, int64_t x_stride, const bf16_t *res, int64_t res_stride,
    const bf16_t *w, bf16_t *out, bf16_t *res_out, int64_t T, int64_t N, float eps)
{
    for (int64_t t = 0; t < T; t++) {
        const bf16_t *s = x + t * x_stride;
        if (res) {
            const bf16_t *r = res + t * res_stride;
            bf16_t *sum = res_out + t * N;
            #pragma omp simd
            for (int64_t i = 0; i < N; i++) sum[i] = bf16_store(bf16_load(s[i]) + bf16_load(r[i]));
            s = sum;
        }
        float squares = 0.f;
        #pragma omp simd reduction(+:squares)
        for (int64_t i = 0; i < N; i++) squares += bf16_load(s[i]) * bf16_load(s[i]);
        const float inv = 1.f / sqrtf(squares / (float)N + eps);
        bf16_t *o = out + t * N;
        #pragma omp simd
        for (int64_t i = 0; i < N; i++)
            o[i] = bf16_store(bf16_load(w[i]) * bf16_load(bf16_store(bf16_load(s[i]) * inv)));
    }
}

/* rotary_f32 for bf16 q, k and out, fp32 cos and sin: each product rounded to fp32, then
   their difference or sum (no fma), rounded to bf16 once: reference.py's bits. */
NO_FMA int rotary_bf16(
    const bf16_t *q, int64_t q_stride_t, int64_t q_stride_h,
    const bf16_t *k, int64_t k_stride_t, int64_t k_stride_h,
    const int64_t *positions, const float *cos, const float *sin, int64_t P,
    bf16_t *out, int64_t T, int64_t H, int64_t HK, int64_t D)
{
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        if (positions[t] < 0 || positions[t] >= P) return 1;
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        for (int64_t h = 0; h < H + HK; h++) {
            const bf16_t *x = h < H ? q + t * q_stride_t + h * q_stride_h
                                    : k + t * k_stride_t + (h - H) * k_stride_h;
            bf16_t *o = out + (t * (H + HK) + h) * D;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = bf16_load(x[i]), x2 = bf16_load(x[i + half]);
                const float x1c = x1 * c[i], x2s = x2 * s[i], x2c = x2 * c[i], x1s = x1 * s[i];
                o[i] = bf16_store(x1c - x2s);
                o[i + half] = bf16_store(x2c + x1s);
            }
        }
    }
    return 0;
}

/* silu_and_mul_f32 for bf16 x and out, as reference.py's bf16 path: out = bf16(bf16(silu(g))
   * u), silu in fp32. e^-g is exp8's (within 2 ulp) where torch's is Sleef's (within 1),
   so silu(g) may differ from torch's in its last fp32 bits, and an output by one bf16
   step where that moves a rounding; a gate under -87 (e^-g clamped, as in fp32) gives
   silu(g) of magnitude under 1e-36 where torch's is 0, and silu(-inf) is -inf
   where torch's is NaN. */
void silu_and_mul_bf16(const bf16_t *x, int64_t x_stride, bf16_t *out, int64_t T, int64_t N)
{
    bf16_t silu[8];
    for (int64_t t = 0; t < T; t++) {
        const bf16_t *g = x + t * x_stride, *u = g + N;
        bf16_t *o = out + t * N;
        int64_t i = 0;
        for (; i + 8 <= N; i += 8) {
            const v8 gv = bf16_load8(g + i);
            bf16_store8(silu, gv / (1.f + exp8(-gv)));
            bf16_store8(o + i, bf16_load8(silu) * bf16_load8(u + i));
        }
        for (; i < N; i++) {
            const float gi = bf16_load(g[i]);
            o[i] = bf16_store(bf16_load(bf16_store(gi / (1.f + expf(-gi)))) * bf16_load(u[i]));
        }
    }
}
