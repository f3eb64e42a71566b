/*
 * Scalar helpers shared by the CPU C kernels (kernels/cpu_build.py builds each kernel file with
 * this directory on the include path): 16-bit float conversion and an exp that vectorises.
 */
#ifndef RAYLANE_CPU_MATH_H
#define RAYLANE_CPU_MATH_H

#include <stdint.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };

#if defined(__FLT16_MAX__)
typedef _Float16 half_t;
#define HAVE_F16 1
#else
#define HAVE_F16 0
#endif

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static inline size_t elem_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

/*
 * exp(x) for x <= 88 (the softmax asks for exp(score - ref), at most e^RESCALE_MARGIN), within
 * ~2 ulp of expf. Cody-Waite reduction x = k ln2 + r, |r| <= ln2 / 2, then the Taylor series
 * of exp(r) to r^7 (truncation error < 5e-9). Below -87 the result is clamped to exp(-87) ~
 * 1.6e-38, which is nothing next to the running sum (always >= 1).
 */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* round x / ln2 to nearest: adding 1.5 * 2^23 pushes the fraction bits out */
    float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = x - k * 0.693145752f; /* ln2 split in two: the high part times k is exact */
    r = r - k * 1.42860677e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)k + 127) << 23; /* 2^k, a normal float: -126 <= k <= 127 */
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return p * two_k;
}

#endif
