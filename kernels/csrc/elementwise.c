/*
 * Fused elementwise ops of a decoder layer on the CPU, one pass over each row instead of the
 * 4-7 eager torch ops (and as many temporaries) they take otherwise:
 *   raylane_rms_norm:    [residual_out = x + residual;] out = weight * rmsnorm(x) (HF's
 *                        LlamaRMSNorm: statistics in float32, normalised row cast to the dtype,
 *                        then the weight product in the dtype; with weight_first HF's
 *                        GptOssRMSNorm: the weight product in float32, then the one cast)
 *   raylane_silu_and_mul x [N, 2I] laid out [gate | up] -> out [N, I] = silu(gate) * up
 *   raylane_rotary       x [T, H, D] (heads D apart) -> out [T, H, D] = x * cos + rotate_half(x)
 *                        * sin over each head's leading R dims, cos/sin [T, R] (HF's rotate-half
 *                        RoPE; R < D: partial rotary, the other D - R dims copied as they are)
 * Rows of x and residual are `*_stride` elements apart (last dim contiguous); outputs are
 * contiguous. Small calls (decode shapes) stay on the calling thread: splitting 100 KB of work
 * across cores costs more in the fork/join than it saves, and on a busy machine the wait for a
 * descheduled worker dominates. Large ones (prefill) split rows over `threads` OpenMP threads.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

/* elements per call below which one thread does it all (~1 MB of float32) */
#define PARALLEL_MIN (1 << 18)

static inline float load(const void *p, int64_t i, int dtype) {
    return dtype == DTYPE_F32 ? ((const float *)p)[i] : bf16_to_float(((const uint16_t *)p)[i]);
}

/* a float as stored in `dtype` and read back: the rounding of a cast to the model dtype */
static inline float round_to(float f, int dtype) {
    return dtype == DTYPE_F32 ? f : bf16_to_float(float_to_bf16(f));
}

static inline void store(void *p, int64_t i, float f, int dtype) {
    if (dtype == DTYPE_F32)
        ((float *)p)[i] = f;
    else
        ((uint16_t *)p)[i] = float_to_bf16(f);
}

/* sum of v[i]^2 in a fixed order: LANES partial sums, element i always in lane i % LANES,
 * then the lanes and the tail in order. `omp simd reduction` lets the compiler peel a loop to
 * align it, so a row's lanes (and its rounding) would depend on its address, and a sequence's
 * logprobs on the batch it shares a step with. Without -ffast-math this order is kept. */
#define LANES 16
static float sum_squares(const float *restrict v, int64_t d) {
    float acc[LANES] = {0.0f};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; ++j) acc[j] += v[i + j] * v[i + j];
    float sq = 0.0f;
    for (int j = 0; j < LANES; ++j) sq += acc[j];
    for (; i < d; ++i) sq += v[i] * v[i];
    return sq;
}

static void norm_row_f32(const float *restrict x, const float *restrict residual,
                         float *restrict res_out, const float *restrict w, float *restrict out,
                         int64_t d, float eps) {
    if (residual) {
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) res_out[i] = x[i] + residual[i];
        x = res_out;
    }
    const float inv = 1.0f / sqrtf(sum_squares(x, d) / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

static void norm_row_16(const void *x, const void *residual, void *res_out, const void *w,
                        void *out, int64_t d, float eps, int weight_first, int dtype) {
    float sq = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
        float s = load(x, i, dtype);
        if (residual) {
            s = round_to(s + load(residual, i, dtype), dtype); /* the add runs in the dtype */
            store(res_out, i, s, dtype);
        }
        sq += s * s;
    }
    const void *src = residual ? res_out : x;
    const float inv = 1.0f / sqrtf(sq / (float)d + eps);
    for (int64_t i = 0; i < d; ++i) {
        const float normed = load(src, i, dtype) * inv;
        store(out, i, load(w, i, dtype) * (weight_first ? normed : round_to(normed, dtype)), dtype);
    }
}

/* residual, res_out: both NULL for a plain norm. weight_first: 0 Llama's order, 1 gpt-oss's
 * (the same in float32). Returns 0, or 2 for an unsupported dtype. */
int raylane_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t res_stride,
                     void *res_out, const void *weight, void *out, int64_t rows, int64_t d,
                     float eps, int weight_first, int dtype, int threads) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 2;
    const size_t es = elem_size(dtype);
    const char *xs = x, *rs = residual;
    char *ro = res_out, *o = out;
#pragma omp parallel for num_threads(threads) if (rows * d >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const void *xr = xs + r * x_stride * es;
        const void *rr = residual ? rs + r * res_stride * es : NULL;
        void *ror = residual ? ro + r * d * es : NULL;
        if (dtype == DTYPE_F32)
            norm_row_f32(xr, rr, ror, weight, (void *)(o + r * d * es), d, eps);
        else
            norm_row_16(xr, rr, ror, weight, o + r * d * es, d, eps, weight_first, dtype);
    }
    return 0;
}

/* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1 so exp never overflows; past
 * exp_clamped's floor e is 0, as libm's expf would round it (silu(-200) = -0, like torch) */
static inline float silu(float g) {
    const float e = fabsf(g) > 87.0f ? 0.0f : exp_clamped(-fabsf(g));
    return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

int raylane_silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t rows, int64_t inter,
                         int dtype, int threads) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 2;
    const size_t es = elem_size(dtype);
    const char *xs = x;
    char *o = out;
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const void *gate = xs + r * x_stride * es;
        const void *up = xs + (r * x_stride + inter) * es;
        void *dst = o + r * inter * es;
        if (dtype == DTYPE_F32) {
            const float *restrict g = gate, *restrict u = up;
            float *restrict y = dst;
#pragma omp simd
            for (int64_t i = 0; i < inter; ++i) y[i] = silu(g[i]) * u[i];
        } else { /* torch: silu in float rounded to bf16, then the bf16 product */
            for (int64_t i = 0; i < inter; ++i) {
                const float a = round_to(silu(load(gate, i, dtype)), dtype);
                store(dst, i, a * load(up, i, dtype), dtype);
            }
        }
    }
    return 0;
}

/*
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for x = [x1, x2]: as the three
 * torch ops compute it, each product and the sum rounded to the dtype on its own. Never
 * contracted into an FMA (GNU C would by default), which would round differently from torch.
 */
__attribute__((optimize("fp-contract=off"))) int raylane_rotary(
    const void *x, int64_t x_stride, const void *cos, const void *sin, void *out, int64_t rows,
    int64_t heads, int64_t d, int64_t rot, int dtype, int threads) {
    if (dtype != DTYPE_F32 && dtype != DTYPE_BF16) return 2;
    if (rot % 2 || rot < 2 || rot > d) return 1;
    const size_t es = elem_size(dtype);
    const int64_t half = rot / 2;
    const char *xs = x, *cs = cos, *ss = sin;
    char *o = out;
#pragma omp parallel for num_threads(threads) if (rows * heads * d >= PARALLEL_MIN) \
    schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const void *c = cs + r * rot * es, *sn = ss + r * rot * es;
        for (int64_t h = 0; h < heads; ++h) {
            const char *xr = xs + (r * x_stride + h * d) * es;
            char *dst = o + (r * heads + h) * d * es;
            if (dtype == DTYPE_F32) {
                const float *restrict xv = (const float *)xr, *restrict cv = c, *restrict sv = sn;
                float *restrict y = (float *)dst;
                for (int64_t i = 0; i < half; ++i) {
                    const float a = xv[i] * cv[i], b = -xv[i + half] * sv[i];
                    y[i] = a + b;
                }
                for (int64_t i = half; i < rot; ++i) {
                    const float a = xv[i] * cv[i], b = xv[i - half] * sv[i];
                    y[i] = a + b;
                }
            } else {
                for (int64_t i = 0; i < rot; ++i) {
                    const float rot_x = i < half ? -load(xr, i + half, dtype) : load(xr, i - half, dtype);
                    const float a = round_to(load(xr, i, dtype) * load(c, i, dtype), dtype);
                    const float b = round_to(rot_x * load(sn, i, dtype), dtype);
                    store(dst, i, a + b, dtype);
                }
            }
            if (rot < d) memcpy(dst + rot * es, xr + rot * es, (size_t)(d - rot) * es);
        }
    }
    return 0;
}
