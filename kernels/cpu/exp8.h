/* The CPU path's eight-floats-at-a-time helpers, shared by decode_attention.c (the
   softmax) and elementwise.c (SiLU). */
#ifndef BATCHGEN_EXP8_H
#define BATCHGEN_EXP8_H

#include <math.h>
#include <stdint.h>

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

#endif
