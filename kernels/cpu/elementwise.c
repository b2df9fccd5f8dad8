/* RMSNorm with an optional residual add, neox rotary, SiLU-and-multiply and the K/V
   store into their cache slots: one pass each where torch takes two to twelve small ops,
   whose dispatch, not their arithmetic, is what they cost at decode batch sizes. Called
   from elementwise.py, which checks what the C code trusts. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exp8.h"

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
