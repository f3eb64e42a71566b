/*
 * Multi-LoRA's add on the CPU, one call per linear layer and step (kernels/lora.py):
 *   y[t] += (x[t] @ A_s^T) @ B_s^T      for each listed token t, s its slot
 * reading the tokens' slots directly: no gather of x, no scatter of the deltas, no temporaries.
 *
 * Weights are in the model dtype (float32, or bfloat16 widened exactly as they load) in the
 * kernel's layout, a fused layer's P parts (q/k/v, gate/up) side by side, R the (padded)
 * rank, VEC = 16 floats:
 *   A^T [in, WP]     per slot; WP = P * R rounded up to VEC (zero columns): one shrink for
 *                    every part at once (they read the same x)
 *   B^T [R, OUTP]    per slot, B's nonzero blocks only: part p's output columns read the
 *                    shrink's columns [p R, (p + 1) R) (the other parts' ranks would add
 *                    zeros); each part's columns padded to a multiple of VEC with zeros
 * each cut into tiles of TILE * VEC columns (a part's last one narrower) stored one after
 * another, a tile of w columns from column c as [rows, w] at c * rows: a tile's weights are one
 * contiguous run. `part_ends[p]`: the end of part p's columns in y.
 *
 * The low-rank math runs in float32 on whole vectors (padding columns and the rows that fill a
 * short block computed and dropped), so every output of a token is the same sum in the same
 * order whatever the batch and whichever tokens share its block; each output gets the whole
 * delta in one add, rounded once to the dtype.
 *
 * Tokens come sorted by slot (`tokens`, `slots`: n of them): blocks of up to BLOCK tokens of
 * one slot share each weight load, and the blocks split over OpenMP threads in order, so each
 * thread streams few slots' weights.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define VEC 16     /* floats per vector */
#define BLOCK 8    /* tokens of one slot computed together */
#define TILE 2     /* vectors per tile (a tile has 1 or 2): BLOCK * TILE accumulators */
/* how far ahead the weights are prefetched (their streams cross pages, where the hardware
 * prefetchers stop): A^T rows in a shrink tile, whole tiles of B^T */
#define PREFETCH_ROWS 64
#define PREFETCH_TILES 4
#define PARALLEL_MIN (1 << 18) /* multiply-adds (~5 us) below which one thread does it all */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef uint16_t half_vec __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t bits_vec __attribute__((vector_size(VEC * sizeof(uint32_t))));

/* VEC values from p + i (float32 or bfloat16, widened exactly) */
static inline vec load_wide(const void *p, int64_t i, int wdtype) {
    if (wdtype == DTYPE_F32) return load_vec((const float *)p + i);
#if defined(__AVX512F__) /* one vpmovzxwd: GCC splits the generic widening into pieces */
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return (vec)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
    half_vec h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    const bits_vec bits = __builtin_convertvector(h, bits_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
#endif
}

static inline int64_t round_up(int64_t n) { return (n + VEC - 1) / VEC * VEC; }

typedef struct {
    const void *x;
    void *y;
    int64_t x_stride, y_stride, in, rank, width, parts, out_padded;
    const int64_t *part_ends;
    int dtype, wdtype; /* of x and y; of the weights */
} Layer;

/* sh[k][c0 + ...] over the tile of `nv` vectors of columns from c0 (stored [in][nv * VEC]
 * from at + c0 * in): sum_i x[k][i] * at[i][c], i in order. Called with constant nv and
 * wdtype (inlined), so the BLOCK * nv sums stay in registers. */
static inline __attribute__((always_inline)) void shrink_tile(const Layer *L, const void *at,
                                                              const float *const *xs, float *sh,
                                                              int64_t c0, int nv, int wdtype) {
    vec acc[BLOCK][TILE] = {{{0}}};
    const int64_t tile = c0 * L->in, row_bytes = nv * VEC * (int64_t)elem_size(wdtype);
    const char *ahead = (const char *)at + tile * (int64_t)elem_size(wdtype);
    ahead += PREFETCH_ROWS * row_bytes;
    for (int64_t i = 0; i < L->in; ++i) {
        __builtin_prefetch(ahead + i * row_bytes);
        for (int v = 0; v < nv; ++v) {
            const vec av = load_wide(at, tile + (i * nv + v) * VEC, wdtype);
            for (int k = 0; k < BLOCK; ++k) acc[k][v] += av * xs[k][i];
        }
    }
    for (int k = 0; k < BLOCK; ++k)
        memcpy(sh + k * L->width + c0, acc[k], sizeof(vec) * (size_t)nv);
}

/* y[col + j] += d[j], j < count <= VEC: the add in float32, rounded once to the dtype (a
 * whole vector at once where it can: bit for bit the scalar rounding of cpu_math.h) */
static inline void add_to_row(const Layer *L, int64_t at, vec d, int64_t count) {
    if (L->dtype == DTYPE_F32) {
        float *y = (float *)L->y + at;
        if (count == VEC) {
            const vec sum = load_vec(y) + d;
            memcpy(y, &sum, sizeof sum);
        } else {
            for (int64_t j = 0; j < count; ++j) y[j] += d[j];
        }
        return;
    }
    uint16_t *y = (uint16_t *)L->y + at;
    if (count < VEC) {
        for (int64_t j = 0; j < count; ++j) y[j] = float_to_bf16(bf16_to_float(y[j]) + d[j]);
        return;
    }
    const vec sum = load_wide(y, 0, DTYPE_BF16) + d;
    bits_vec bits;
    memcpy(&bits, &sum, sizeof bits);
    const bits_vec nan = (bits_vec)((bits & 0x7fffffffu) > 0x7f800000u); /* all ones: NaN */
    const bits_vec even = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const half_vec h = __builtin_convertvector((even & ~nan) | (((bits >> 16) | 0x40u) & nan),
                                               half_vec);
    memcpy(y, &h, sizeof h);
}

/* y[rows[k]][col + ...] += the deltas of the tile of `nv` vectors of padded columns from o0
 * (B^T stored [R][nv * VEC] from bt + o0 * R; the part's ranks from shrink column `first`),
 * `len` real columns, for k < nb */
static inline __attribute__((always_inline)) void expand_tile(const Layer *L, const void *bt,
                                                              const float *sh, int64_t first,
                                                              int64_t o0, int nv, int wdtype,
                                                              const int32_t *rows, int nb,
                                                              int64_t col, int64_t len) {
    vec acc[BLOCK][TILE] = {{{0}}};
    const int64_t tile = o0 * L->rank, row_bytes = nv * VEC * (int64_t)elem_size(wdtype);
    const char *ahead = (const char *)bt + tile * (int64_t)elem_size(wdtype);
    ahead += PREFETCH_TILES * L->rank * row_bytes;
    for (int64_t r = 0; r < L->rank; ++r) {
        __builtin_prefetch(ahead + r * row_bytes);
        vec bv[TILE];
        for (int v = 0; v < nv; ++v) bv[v] = load_wide(bt, tile + (r * nv + v) * VEC, wdtype);
        for (int k = 0; k < BLOCK; ++k) {
            const float s = sh[k * L->width + first + r];
            for (int v = 0; v < nv; ++v) acc[k][v] += bv[v] * s;
        }
    }
    for (int k = 0; k < nb; ++k)
        for (int v = 0; v < nv; ++v) {
            const int64_t left = len - v * VEC;
            add_to_row(L, rows[k] * L->y_stride + col + v * VEC, acc[k][v],
                       left < VEC ? left : VEC);
        }
}

/* the shrink's tiles: TILE vectors of columns each, the last one narrower */
static inline __attribute__((always_inline)) void shrink_as(const Layer *L, const void *at,
                                                            const float *const *xs, float *sh,
                                                            int wdtype) {
    for (int64_t c0 = 0; c0 < L->width; c0 += TILE * VEC) {
        const int64_t left = (L->width - c0) / VEC;
        if (left >= TILE) /* a whole tile, else its last vector */
            shrink_tile(L, at, xs, sh, c0, TILE, wdtype);
        else
            shrink_tile(L, at, xs, sh, c0, 1, wdtype);
    }
}

static void shrink(const Layer *L, const void *at, const float *const *xs, float *sh) {
    if (L->wdtype == DTYPE_F32)
        shrink_as(L, at, xs, sh, DTYPE_F32);
    else
        shrink_as(L, at, xs, sh, DTYPE_BF16);
}

/* every part's columns, a tile at a time: part p's real columns [begin, end) of y sit at
 * padded columns [padded, padded + round_up(end - begin)) of bt */
static inline __attribute__((always_inline)) void expand_as(const Layer *L, const void *bt,
                                                            const int32_t *rows, int nb,
                                                            const float *sh, int wdtype) {
    int64_t begin = 0, padded = 0;
    for (int64_t p = 0; p < L->parts; ++p) {
        const int64_t end = L->part_ends[p], first = p * L->rank;
        for (int64_t o = 0; begin + o < end; o += TILE * VEC) {
            const int64_t len = end - begin - o < TILE * VEC ? end - begin - o : TILE * VEC;
            const int64_t o0 = padded + o, col = begin + o;
            if (len > VEC)
                expand_tile(L, bt, sh, first, o0, TILE, wdtype, rows, nb, col, len);
            else
                expand_tile(L, bt, sh, first, o0, 1, wdtype, rows, nb, col, len);
        }
        padded += round_up(end - begin);
        begin = end;
    }
}

static void expand(const Layer *L, const void *bt, const int32_t *rows, int nb, const float *sh) {
    if (L->wdtype == DTYPE_F32)
        expand_as(L, bt, rows, nb, sh, DTYPE_F32);
    else
        expand_as(L, bt, rows, nb, sh, DTYPE_BF16);
}

/* one block: nb <= BLOCK tokens of one slot; short blocks repeat their last row (dropped) */
static void run_block(const Layer *L, const void *at, const void *bt, const int32_t *rows,
                      int nb, float *scratch, float *sh) {
    const float *xs[BLOCK];
    for (int k = 0; k < BLOCK; ++k) {
        const int64_t row = rows[k < nb ? k : nb - 1] * L->x_stride;
        if (L->dtype == DTYPE_F32) {
            xs[k] = (const float *)L->x + row;
        } else if (k < nb) {
            const uint16_t *x = (const uint16_t *)L->x + row;
            for (int64_t i = 0; i < L->in; ++i) scratch[k * L->in + i] = bf16_to_float(x[i]);
            xs[k] = scratch + k * L->in;
        } else {
            xs[k] = xs[nb - 1];
        }
    }
    shrink(L, at, xs, sh);
    expand(L, bt, rows, nb, sh);
}

/* starts of the blocks: runs of one slot cut every BLOCK tokens; returns their count */
static int64_t block_starts(const int32_t *slots, int64_t n, int64_t *starts) {
    int64_t count = 0;
    for (int64_t t = 0; t < n; ++t)
        if (t == 0 || slots[t] != slots[t - 1] || t - starts[count - 1] == BLOCK)
            starts[count++] = t;
    starts[count] = n;
    return count;
}

/* dtype: x's and y's; wdtype: the weights'. Returns 0, or -1 out of memory. */
int raylane_lora_add(const void *x, int64_t x_stride, void *y, int64_t y_stride, int dtype,
                     const int32_t *tokens, const int32_t *slots, int64_t n, const void *at,
                     const void *bt, int wdtype, int64_t in, int64_t rank,
                     const int64_t *part_ends, int64_t parts, int threads) {
    if (n <= 0) return 0;
    int64_t out_padded = 0;
    for (int64_t p = 0; p < parts; ++p)
        out_padded += round_up(part_ends[p] - (p ? part_ends[p - 1] : 0));
    const Layer L = {x, y, x_stride, y_stride, in, rank, round_up(parts * rank), parts,
                     out_padded, part_ends, dtype, wdtype};
    int64_t *starts = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!starts) return -1;
    const int64_t blocks = block_starts(slots, n, starts);
    const size_t slot_a = (size_t)(in * L.width) * elem_size(wdtype);
    const size_t slot_b = (size_t)(rank * out_padded) * elem_size(wdtype);
    const int64_t work = n * (in * L.width + rank * out_padded);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (work >= PARALLEL_MIN) reduction(| : failed)
    {
        /* bf16 rows as float32, and the block's shrink */
        float *scratch = malloc(sizeof(float) * (size_t)(BLOCK * (in + L.width)));
        failed = scratch == NULL;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            if (!scratch) continue;
            const int64_t t0 = starts[b];
            const size_t s = (size_t)slots[t0];
            run_block(&L, (const char *)at + s * slot_a, (const char *)bt + s * slot_b,
                      tokens + t0, (int)(starts[b + 1] - t0), scratch, scratch + BLOCK * in);
        }
        free(scratch);
    }
    free(starts);
    return failed ? -1 : 0;
}
