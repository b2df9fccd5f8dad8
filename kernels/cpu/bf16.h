/* bf16 to and from fp32, shared by decode_attention.c (a bf16 K/V cache) and
   elementwise.c (the bf16 norms, rotary, SiLU and K/V store). A bf16 is the upper 16
   bits of an fp32; fp32 -> bf16 rounds to nearest, ties to even, and a NaN becomes the
   quiet NaN 0x7fc0, as torch's .to(torch.bfloat16) does. */
#ifndef BATCHGEN_BF16_H
#define BATCHGEN_BF16_H

#include <stdint.h>
#include <string.h>

#include "exp8.h"

typedef uint16_t bf16_t;
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));

static inline float bf16_load(bf16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16_t bf16_store(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return f != f ? 0x7fc0 : (bf16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* The same, eight at a time. */
static inline v8 bf16_load8(const bf16_t *p)
{
    h8 h;
    memcpy(&h, p, sizeof h);
    return (v8)(__builtin_convertvector(h, u8) << 16);
}

static inline void bf16_store8(bf16_t *p, v8 f)
{
    const u8 bits = (u8)f;
    u8 r = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const u8 nan = (u8)(f != f);
    r = (r & ~nan) | (0x7fc0u & nan);
    const h8 h = __builtin_convertvector(r, h8);
    memcpy(p, &h, sizeof h);
}

#endif
