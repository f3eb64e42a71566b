/*
 * Multi-LoRA's add on the CPU, one call per linear layer and step (kernels/lora.py):
 *   y[t] += (x[t] @ A_s^T) @ B_s^T      for each listed token t, s its slot
 * reading the tokens' slots directly: no gather of x, no scatter of the deltas, no temporaries.
 *
 * Weights are float32 in the kernel's layout (whatever the model dtype), a fused layer's P
 * parts (q/k/v, gate/up) side by side, R the (padded) rank, VEC = 16 floats:
 *   at [S, in, WP]     A transposed, WP = P * R rounded up to VEC (zero columns): one shrink
 *                      for every part at once (they read the same x)
 *   bt [S, R, OUTP]    B's nonzero blocks only: part p's output columns read the shrink's
 *                      columns [p R, (p + 1) R) (the other parts' ranks would add zeros); each
 *                      part's columns padded to a multiple of VEC with zeros, parts in order
 * `part_ends[p]`: the end of part p's columns in y.
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
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h"

#define VEC 16     /* floats per vector */
#define BLOCK 4    /* tokens of one slot computed together */
#define TILE 4     /* vectors per tile: accumulators = BLOCK * TILE vectors */
#define PARALLEL_MIN (1 << 16) /* multiply-adds per call below which one thread does it all */

typedef float vec __attribute__((vector_size(VEC * sizeof(float))));

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef uint16_t half_vec __attribute__((vector_size(VEC * sizeof(uint16_t))));
typedef uint32_t bits_vec __attribute__((vector_size(VEC * sizeof(uint32_t))));

/* VEC weights from p + i (float32 or bfloat16, widened exactly) */
static inline vec load_weights(const void *p, int64_t i, int wdtype) {
    if (wdtype == DTYPE_F32) return load_vec((const float *)p + i);
    half_vec h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    const bits_vec bits = __builtin_convertvector(h, bits_vec) << 16;
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
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
    const int64_t tile = c0 * L->in;
    for (int64_t i = 0; i < L->in; ++i) {
        for (int v = 0; v < nv; ++v) {
            const vec av = load_weights(at, tile + (i * nv + v) * VEC, wdtype);
            for (int k = 0; k < BLOCK; ++k) acc[k][v] += av * xs[k][i];
        }
    }
    for (int k = 0; k < BLOCK; ++k)
        memcpy(sh + k * L->width + c0, acc[k], sizeof(vec) * (size_t)nv);
}

/* delta[k][...] over the tile of `nv` vectors of padded columns from o0 (stored
 * [R][nv * VEC] from bt + o0 * R), their part's ranks from shrink column `first` */
static inline __attribute__((always_inline)) void expand_tile(const Layer *L, const void *bt,
                                                              const float *sh, int64_t first,
                                                              int64_t o0, int nv, int wdtype,
                                                              float delta[BLOCK][TILE * VEC]) {
    vec acc[BLOCK][TILE] = {{{0}}};
    const int64_t tile = o0 * L->rank;
    for (int64_t r = 0; r < L->rank; ++r) {
        vec bv[TILE];
        for (int v = 0; v < nv; ++v) bv[v] = load_weights(bt, tile + (r * nv + v) * VEC, wdtype);
        for (int k = 0; k < BLOCK; ++k) {
            const float s = sh[k * L->width + first + r];
            for (int v = 0; v < nv; ++v) acc[k][v] += bv[v] * s;
        }
    }
    for (int k = 0; k < BLOCK; ++k) memcpy(delta[k], acc[k], sizeof(vec) * (size_t)nv);
}

/* the shrink's tiles: TILE vectors of columns each, the last one narrower */
static inline __attribute__((always_inline)) void shrink_as(const Layer *L, const void *at,
                                                            const float *const *xs, float *sh,
                                                            int wdtype) {
    for (int64_t c0 = 0; c0 < L->width; c0 += TILE * VEC) {
        const int64_t left = (L->width - c0) / VEC;
        switch (left < TILE ? left : TILE) {
        case 1: shrink_tile(L, at, xs, sh, c0, 1, wdtype); break;
        case 2: shrink_tile(L, at, xs, sh, c0, 2, wdtype); break;
        case 3: shrink_tile(L, at, xs, sh, c0, 3, wdtype); break;
        default: shrink_tile(L, at, xs, sh, c0, TILE, wdtype); break;
        }
    }
}

static void shrink(const Layer *L, const void *at, const float *const *xs, float *sh) {
    if (L->wdtype == DTYPE_F32)
        shrink_as(L, at, xs, sh, DTYPE_F32);
    else
        shrink_as(L, at, xs, sh, DTYPE_BF16);
}

/* y[rows[k]][col + j] += delta[k][j], j < len, k < nb: one add, rounded once to the dtype */
static void add_delta(const Layer *L, const int32_t *rows, int nb, int64_t col, int64_t len,
                      float delta[BLOCK][TILE * VEC]) {
    for (int k = 0; k < nb; ++k) {
        const int64_t at = rows[k] * L->y_stride + col;
        if (L->dtype == DTYPE_F32) {
            float *y = (float *)L->y + at;
            for (int64_t j = 0; j < len; ++j) y[j] += delta[k][j];
        } else {
            uint16_t *y = (uint16_t *)L->y + at;
            for (int64_t j = 0; j < len; ++j)
                y[j] = float_to_bf16(bf16_to_float(y[j]) + delta[k][j]);
        }
    }
}

/* every part's columns, a tile at a time: part p's real columns [begin, end) of y sit at
 * padded columns [padded, padded + round_up(end - begin)) of bt */
static inline __attribute__((always_inline)) void expand_as(const Layer *L, const void *bt,
                                                            const int32_t *rows, int nb,
                                                            const float *sh, int wdtype) {
    float delta[BLOCK][TILE * VEC];
    int64_t begin = 0, padded = 0;
    for (int64_t p = 0; p < L->parts; ++p) {
        const int64_t end = L->part_ends[p], first = p * L->rank;
        for (int64_t o = 0; begin + o < end; o += TILE * VEC) {
            const int64_t len = end - begin - o < TILE * VEC ? end - begin - o : TILE * VEC;
            switch (round_up(len) / VEC) {
            case 1: expand_tile(L, bt, sh, first, padded + o, 1, wdtype, delta); break;
            case 2: expand_tile(L, bt, sh, first, padded + o, 2, wdtype, delta); break;
            case 3: expand_tile(L, bt, sh, first, padded + o, 3, wdtype, delta); break;
            default: expand_tile(L, bt, sh, first, padded + o, TILE, wdtype, delta); break;
            }
            add_delta(L, rows, nb, begin + o, len, delta);
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
