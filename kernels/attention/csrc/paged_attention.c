/*
 * Paged attention on the CPU: K/V are read straight from the paged cache through the block
 * tables, never gathered into a padded copy of every context.
 *
 * Plain C with no torch headers, so it compiles in about a second; cpu_kernel.py builds it once
 * per machine and calls it through ctypes. Layouts (strides in elements, last dim contiguous):
 *   q, out           [T, H, D]            row and head strides given (q is often a slice of a
 *                                         fused qkv projection, so its rows are not H * D apart)
 *   k_cache          [num_slots, KVH, D]  contiguous; slot = block * block_size + offset
 *   v_cache          [num_slots, KVH, Dv] heads Dv apart, slots v_slot apart: Dv may be less
 *                                         than D and v_cache a view into k_cache (MLA's
 *                                         absorbed form: values are the keys' latent part)
 *   block_tables     [B, W] int32         row stride given; entries past a sequence's blocks
 *                                         are never read
 *   seq_lens         [B] int32            context length after this step (cached + new)
 *   query_start_loc  [B + 1] int32        sequence i owns query rows [qsl[i], qsl[i + 1])
 * Query j of sequence i sits at position seq_lens[i] - q_len + j and attends keys 0..position
 * (causal), or with a sliding `window` > 0 only its last `window` keys (blocks before them are
 * never read: a window's freed blocks may hold anything); the caller has already written this
 * step's K/V into the cache. With `aligned` (the batch-invariant mode) a window's key chunks
 * start at multiples of LANES, as full attention's do, rather than at the window of a tile's
 * first row: a row then visits the same chunks, lane for lane, whatever tile or prefill split
 * it falls in; the chunk's keys before that first window are zeros, never read. `sinks` (float32 [H], or NULL): per query head, a logit that joins
 * the softmax's denominator and adds nothing to the sum (gpt-oss).
 *
 * Work is cut into items (sequence, run of kv heads, tile of query rows). Inside an item every
 * query head of a kv head and every row of the tile ("query vectors") share each chunk of LANES
 * keys, so a decode reads each key row from memory once for all H / KVH heads. Decodes take
 * several kv heads per item, so that a chunk is one contiguous run of each slot rather than
 * D-element pieces KVH * D apart, which memory serves far better once the cache outgrows the
 * CPU caches. The chunk's keys and values are copied into float32 buffers (converted from
 * 16-bit types); the softmax is online over chunks; everything accumulates in float32.
 *
 * No -ffast-math: the one reduction that must vectorise (the scores) is written as a shuffle
 * tree with GCC/clang vector extensions, the small ones say `omp simd reduction`, and exp is a
 * polynomial that vectorises (libm's expf does not without -ffast-math).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_math.h" /* kernels/csrc: dtypes, bf16, exp_clamped */

/* Return codes; cpu_kernel.py turns them into exceptions. */
enum {
    PA_OK = 0,
    PA_BAD_SHAPE = 1,       /* a size is not positive, or H is not a multiple of KVH */
    PA_BAD_DTYPE = 2,       /* unknown dtype, or float16 without compiler support */
    PA_BAD_QUERY_LOC = 3,   /* query_start_loc decreases or runs past T */
    PA_BAD_SEQ_LEN = 4,     /* a sequence has more queries than context */
    PA_BAD_BLOCK_TABLE = 5, /* context needs more blocks than W, or a block id is out of range */
    PA_NO_MEMORY = 6,
};

/* Query vectors per kv head of a prefill tile: 32 keeps q, accumulators and a key chunk in L1
 * for D = 64. */
#define TILE_VECTORS 32
/* Tiles of at most this many query rows (decodes, mostly) take several kv heads per item... */
#define SHORT_TILE 4
/* ...as many as keep one chunk's keys and values, in float, within this many bytes (~L1) */
#define CHUNK_BYTES (32 * 1024)

/*
 * One vector register of floats; a chunk is LANES keys. With AVX-512 that is 16, otherwise 8
 * (32-byte vectors are native on AVX2 and split cleanly in two elsewhere; 64-byte ones would
 * not fit the 16 partial sums of chunk_scores in AVX2's 16 registers).
 */
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

#define ALWAYS_INLINE inline __attribute__((always_inline))

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (ivec){__VA_ARGS__})
#endif

typedef struct {
    const void *q;
    int64_t q_row, q_head;
    const void *k_cache, *v_cache;
    int64_t num_slots;
    const int32_t *block_tables;
    int64_t table_row;
    int table_width;
    const int32_t *seq_lens, *query_start_loc;
    void *out;
    int64_t out_row, out_head;
    int num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype;
    float scale;
    int64_t v_slot; /* elements between two slots of v_cache */
    int v_dim;
    int window;         /* > 0: a query sees its last `window` keys; 0: every earlier key */
    const float *sinks; /* [H] float32, or NULL */
    int aligned;        /* window chunks on multiples of LANES (the batch-invariant mode) */
} Problem;

typedef struct {
    int seq, kv_begin, kv_end, row_begin, row_end; /* rows relative to the sequence's first */
    int64_t cost; /* keys visited * query rows * kv heads, for ordering */
} Item;

/*
 * Per-thread buffers, sized for the largest item. Rows are `padded` floats (head_dim rounded
 * up to LANES) and 64-byte aligned; the padding columns are zeroed once and never written, so
 * they add nothing to a dot product.
 */
typedef struct {
    int padded;
    float *q;     /* [M, padded] queries of the tile, pre-multiplied by scale */
    float *acc;   /* [M, padded] unnormalised output */
    float *prob;  /* [M, LANES] scores, then probabilities, of the current chunk */
    float *ref;   /* [M] running reference for the exps: the max score, give or take a margin */
    float *sum;   /* [M, LANES] running sums of exp(score - ref), lane by lane */
    int *limit;   /* [M] keys of the current chunk the vector may attend (0..LANES) */
    int *start;   /* [M] its first such key (> 0 where a window begins inside the chunk) */
    float *k, *v; /* [LANES, heads, padded] the current chunk in float; rows past its end 0 */
} Scratch;

/* ---- element conversion --------------------------------------------------------------- */

/* d elements of `dtype` at src -> floats times `mul` */
static void load_row(const void *src, int dtype, int d, float mul, float *restrict dst) {
    if (dtype == DTYPE_F32) {
        const float *restrict s = src;
#pragma omp simd
        for (int i = 0; i < d; ++i) dst[i] = s[i] * mul;
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *restrict s = src;
#pragma omp simd
        for (int i = 0; i < d; ++i) dst[i] = bf16_to_float(s[i]) * mul;
    }
#if HAVE_F16
    else {
        const half_t *restrict s = src;
#pragma omp simd
        for (int i = 0; i < d; ++i) dst[i] = (float)s[i] * mul;
    }
#endif
}

static void store_row(const float *restrict src, float mul, int dtype, int d, void *dst) {
    if (dtype == DTYPE_F32) {
        float *restrict o = dst;
#pragma omp simd
        for (int i = 0; i < d; ++i) o[i] = src[i] * mul;
    } else if (dtype == DTYPE_BF16) {
        uint16_t *restrict o = dst;
        for (int i = 0; i < d; ++i) o[i] = float_to_bf16(src[i] * mul);
    }
#if HAVE_F16
    else {
        half_t *restrict o = dst;
        for (int i = 0; i < d; ++i) o[i] = (half_t)(src[i] * mul);
    }
#endif
}

/* ---- math ----------------------------------------------------------------------------- */

static inline vec load_vec(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* memcpy, not a cast: no alignment or aliasing assumptions */
    return v;
}

static inline void store_vec(float *p, vec v) { memcpy(p, &v, sizeof v); }

/*
 * The scores of one query against a chunk of LANES keys are LANES dot products. Each key first
 * gets a vector of partial products (`partial`); a fold then adds the low and high halves of two
 * such vectors into one, so after log2(LANES) rounds of folding one vector holds all LANES sums:
 * LANES - 1 folds instead of LANES horizontal sums. Pairing key j with key j + LANES / 2 first,
 * then j with j + LANES / 4, ... leaves key j's sum in lane j.
 */
#if LANES == 16
static ALWAYS_INLINE vec fold8(vec a, vec b) {
    return SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
static ALWAYS_INLINE vec fold4(vec a, vec b) {
    return SHUFFLE(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           SHUFFLE(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
static ALWAYS_INLINE vec fold2(vec a, vec b) {
    return SHUFFLE(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           SHUFFLE(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
static ALWAYS_INLINE vec fold1(vec a, vec b) {
    return SHUFFLE(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           SHUFFLE(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}
#else
static ALWAYS_INLINE vec fold4(vec a, vec b) {
    return SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
}
static ALWAYS_INLINE vec fold2(vec a, vec b) {
    return SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}
static ALWAYS_INLINE vec fold1(vec a, vec b) {
    return SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}
#endif

/* q [padded] times key row j (rows `stride` apart), lane by lane; the lanes sum to q . k_j */
static ALWAYS_INLINE vec partial(const float *q, const float *k, int64_t stride, int j,
                                 int padded) {
    vec acc = {0};
    for (int c = 0; c < padded; c += LANES) acc += load_vec(q + c) * load_vec(k + j * stride + c);
    return acc;
}

#if LANES == 16
static ALWAYS_INLINE vec tree8(const float *q, const float *k, int64_t stride, int j,
                                int padded) {
    return fold8(partial(q, k, stride, j, padded), partial(q, k, stride, j + 8, padded));
}
static ALWAYS_INLINE vec tree4(const float *q, const float *k, int64_t stride, int j,
                                int padded) {
    return fold4(tree8(q, k, stride, j, padded), tree8(q, k, stride, j + 4, padded));
}
#else
static ALWAYS_INLINE vec tree4(const float *q, const float *k, int64_t stride, int j,
                                int padded) {
    return fold4(partial(q, k, stride, j, padded), partial(q, k, stride, j + 4, padded));
}
#endif
static ALWAYS_INLINE vec tree2(const float *q, const float *k, int64_t stride, int j,
                                int padded) {
    return fold2(tree4(q, k, stride, j, padded), tree4(q, k, stride, j + 2, padded));
}

/* q [padded] against LANES key rows `stride` apart -> LANES scores, key j in lane j */
static ALWAYS_INLINE vec chunk_scores(const float *q, const float *k, int64_t stride, int padded) {
    return fold1(tree2(q, k, stride, 0, padded), tree2(q, k, stride, 1, padded));
}

/* ---- one item ------------------------------------------------------------------------- */

/* LANES consecutive keys of a run of kv heads: row j of head h at k + h * head_step + j * stride */
typedef struct {
    const float *k, *v;
    int64_t stride, head_step;
    int first, n; /* position of row 0; rows past n are zero and never weighted */
} Chunk;

/*
 * The keys at positions first .. first + n - 1 of kv heads kv_begin .. kv_begin + heads - 1,
 * copied (float32) or converted into s->k, s->v, rows past n zeroed: the math only ever sees
 * padded float rows. Rows before position `floor` are zeroed too and never read (an aligned
 * window's chunk may begin in blocks the window freed). Float32 is copied too, although it could be read in place: a copy reads
 * each slot's run of heads front to back, which the memory system streams far better than the
 * D-element pieces the math would pick out of it (about 1.3x faster per call once the cache
 * outgrows the CPU caches, as it does across a model's layers; 1.2x slower while it fits).
 */
static Chunk fetch_chunk(const Problem *p, const int32_t *table, int kv_begin, int heads,
                         int first, int n, int floor, Scratch *s) {
    const int bs = p->block_size, d = p->head_dim, dv = p->v_dim, padded = s->padded;
    const int64_t slot_stride = (int64_t)p->num_kv_heads * d;
    const int skip = floor > first ? floor - first : 0; /* < n: the chunk holds floor */
    int block = (first + skip) / bs, offset = (first + skip) % bs; /* no division per row */
    const size_t es = elem_size(p->dtype);
    const int64_t row = (int64_t)heads * padded;
    if (skip > 0) {
        memset(s->k, 0, sizeof(float) * skip * row);
        memset(s->v, 0, sizeof(float) * skip * row);
    }
    for (int r = skip; r < n; ++r) {
        const int64_t slot = (int64_t)table[block] * bs + offset;
        const char *k = (const char *)p->k_cache + (slot * slot_stride + kv_begin * d) * es;
        const char *v = (const char *)p->v_cache + (slot * p->v_slot + kv_begin * dv) * es;
        if (padded == d) { /* the heads' rows are contiguous both here and in the cache */
            load_row(k, p->dtype, heads * d, 1.0f, s->k + r * row);
        } else {
            for (int h = 0; h < heads; ++h)
                load_row(k + h * d * es, p->dtype, d, 1.0f, s->k + r * row + h * padded);
        }
        if (padded == dv) {
            load_row(v, p->dtype, heads * dv, 1.0f, s->v + r * row);
        } else { /* columns dv .. padded stay the zeros scratch_init wrote */
            for (int h = 0; h < heads; ++h)
                load_row(v + h * dv * es, p->dtype, dv, 1.0f, s->v + r * row + h * padded);
        }
        if (++offset == bs) offset = 0, ++block;
    }
    if (n < LANES) {
        memset(s->k + n * row, 0, sizeof(float) * (LANES - n) * row);
        memset(s->v + n * row, 0, sizeof(float) * (LANES - n) * row);
    }
    return (Chunk){s->k, s->v, row, padded, first, n};
}

/*
 * Online softmax step of query vector m: its chunk scores become exp(score - ref), 0 past its
 * limit whatever the score there. `ref` is the vector's running reference, raised (and acc and
 * the sums rescaled to it) only when a score beats it by more than RESCALE_MARGIN: then the
 * exps need not wait for this chunk's max, and the rare rescale is a predictable branch.
 * Probabilities stay <= e^8 ~ 3e3, far from float32 overflow even summed over 1e30 keys; being
 * relative, float32 rounding does not care about the scale. The sums stay LANES wide until the
 * item ends, so no horizontal sum per chunk either.
 */
#define RESCALE_MARGIN 8.0f
static ALWAYS_INLINE void softmax_update(Scratch *s, int m, const int padded) {
    float *restrict prob = s->prob + m * LANES;
    float *restrict sum = s->sum + m * LANES;
    const int n = s->limit[m], first = s->start[m];
    float chunk_max = -INFINITY;
#pragma omp simd reduction(max : chunk_max)
    for (int j = 0; j < LANES; ++j) {
        const float x = j >= first && j < n ? prob[j] : -INFINITY;
        chunk_max = x > chunk_max ? x : chunk_max;
    }
    if (chunk_max > s->ref[m] + RESCALE_MARGIN) { /* always for the first chunk: ref is -inf */
        const float corr = exp_clamped(s->ref[m] - chunk_max);
        float *restrict acc = s->acc + m * padded;
#pragma omp simd
        for (int i = 0; i < padded; ++i) acc[i] *= corr;
#pragma omp simd
        for (int j = 0; j < LANES; ++j) sum[j] *= corr;
        s->ref[m] = chunk_max;
    }
    const float ref = s->ref[m];
#pragma omp simd
    for (int j = 0; j < LANES; ++j) {
        const float e = j >= first && j < n ? exp_clamped(prob[j] - ref) : 0.0f;
        prob[j] = e;
        sum[j] += e;
    }
}

/*
 * acc [padded] += sum over j < n of prob[j] * v_j (rows `stride` apart): four LANES-wide
 * column slices at a time, even and odd rows into separate accumulators, so that eight
 * independent FMA chains hide the FMA latency. Rows past n (the vector's causal limit) are
 * skipped, not weighted by 0, so that no 0 * inf can turn into NaN.
 */
static ALWAYS_INLINE void accumulate_values(float *acc, const float *prob, const float *v,
                                            int64_t stride, int n, int padded) {
    int col = 0;
    for (; col + 4 * LANES <= padded; col += 4 * LANES) {
        vec a0 = load_vec(acc + col), a1 = load_vec(acc + col + LANES);
        vec a2 = load_vec(acc + col + 2 * LANES), a3 = load_vec(acc + col + 3 * LANES);
        vec b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
        int j = 0;
        for (; j + 1 < n; j += 2) {
            const float *x = v + j * stride + col, *y = x + stride;
            const float p = prob[j], r = prob[j + 1];
            a0 += p * load_vec(x), a1 += p * load_vec(x + LANES);
            a2 += p * load_vec(x + 2 * LANES), a3 += p * load_vec(x + 3 * LANES);
            b0 += r * load_vec(y), b1 += r * load_vec(y + LANES);
            b2 += r * load_vec(y + 2 * LANES), b3 += r * load_vec(y + 3 * LANES);
        }
        if (j < n) {
            const float *x = v + j * stride + col;
            const float p = prob[j];
            a0 += p * load_vec(x), a1 += p * load_vec(x + LANES);
            a2 += p * load_vec(x + 2 * LANES), a3 += p * load_vec(x + 3 * LANES);
        }
        store_vec(acc + col, a0 + b0), store_vec(acc + col + LANES, a1 + b1);
        store_vec(acc + col + 2 * LANES, a2 + b2), store_vec(acc + col + 3 * LANES, a3 + b3);
    }
    for (; col < padded; col += LANES) { /* head dims that are not a multiple of 4 * LANES */
        vec a = load_vec(acc + col), b = {0};
        int j = 0;
        for (; j + 1 < n; j += 2) {
            a += prob[j] * load_vec(v + j * stride + col);
            b += prob[j + 1] * load_vec(v + (j + 1) * stride + col);
        }
        if (j < n) a += prob[j] * load_vec(v + j * stride + col);
        store_vec(acc + col, a + b);
    }
}

/*
 * The query vectors m0 .. m0 + count - 1, all of the chunk's kv head `head` (counted from the
 * item's first), against that head's keys; vector m0 + i is row i / group of the tile, whose
 * first row sits at position pos0. `padded` is s->padded, passed so that callers can make it a
 * compile-time constant.
 */
static ALWAYS_INLINE void attend_chunk(Scratch *s, const Chunk *c, int head, int m0, int count,
                                       int pos0, int group, int window, const int padded) {
    const float *k = c->k + head * c->head_step, *v = c->v + head * c->head_step;
    /* Three passes over the vectors rather than one doing all three steps per vector: the
     * softmax step is a long chain of dependent ops (max, exp, sum), and with the scores of
     * several vectors ready the CPU overlaps their chains. */
    for (int i = 0, m = m0; i < count; ++i, ++m) {
        const int last = pos0 + i / group - c->first; /* last visible key of the chunk, if >= 0 */
        const int first = window > 0 ? last - window + 1 : 0; /* first, if > 0 (a window) */
        s->start[m] = first > 0 ? first : 0;
        s->limit[m] = last < 0 ? 0 : (last + 1 < c->n ? last + 1 : c->n);
        if (s->start[m] >= s->limit[m]) s->limit[m] = 0; /* the window starts past the chunk */
        if (s->limit[m] > 0)
            store_vec(s->prob + m * LANES, chunk_scores(s->q + m * padded, k, c->stride, padded));
    }
    for (int m = m0; m < m0 + count; ++m)
        if (s->limit[m] > 0) softmax_update(s, m, padded);
    for (int m = m0; m < m0 + count; ++m)
        if (s->limit[m] > 0)
            accumulate_values(s->acc + m * padded, s->prob + m * LANES, v, c->stride,
                              s->limit[m], padded);
}

/* The query head of an item's query vector m. Vectors run kv head by kv head, then row by row,
 * then query head by query head within the kv head's group. */
static int vector_head(const Problem *p, const Item *it, int m) {
    const int group = p->num_heads / p->num_kv_heads;
    const int per_head = (it->row_end - it->row_begin) * group;
    return (it->kv_begin + m / per_head) * group + m % per_head % group;
}

/* Where query vector m of an item lives in q and out, in elements. */
static int64_t vector_offset(const Problem *p, const Item *it, int m, int64_t row_stride,
                             int64_t head_stride) {
    const int group = p->num_heads / p->num_kv_heads;
    const int per_head = (it->row_end - it->row_begin) * group;
    const int64_t row = p->query_start_loc[it->seq] + it->row_begin + m % per_head / group;
    return row * row_stride + (int64_t)vector_head(p, it, m) * head_stride;
}

static void attend_item(const Problem *p, const Item *it, Scratch *s) {
    const int d = p->head_dim, padded = s->padded;
    const int group = p->num_heads / p->num_kv_heads;
    const size_t es = elem_size(p->dtype);
    const int q_len = p->query_start_loc[it->seq + 1] - p->query_start_loc[it->seq];
    const int pos0 = p->seq_lens[it->seq] - q_len + it->row_begin; /* the tile's first row */
    const int rows = it->row_end - it->row_begin, heads = it->kv_end - it->kv_begin;
    const int per_head = rows * group, num_vectors = heads * per_head;

    for (int m = 0; m < num_vectors; ++m) {
        const int64_t at = vector_offset(p, it, m, p->q_row, p->q_head);
        load_row((const char *)p->q + at * es, p->dtype, d, p->scale, s->q + m * padded);
        s->ref[m] = -INFINITY;
    }
    memset(s->acc, 0, sizeof(float) * num_vectors * padded);
    memset(s->sum, 0, sizeof(float) * num_vectors * LANES);

    const int32_t *table = p->block_tables + it->seq * p->table_row;
    const int num_keys = pos0 + rows; /* the tile's last row sees keys 0 .. num_keys - 1 */
    /* from the first row's window (`floor`), or the chunk holding it where chunks align */
    const int window = p->window, floor = window > 0 && pos0 >= window ? pos0 - window + 1 : 0;
    const int lo = p->aligned ? floor / LANES * LANES : floor;
    for (int first = lo; first < num_keys; first += LANES) {
        const int n = num_keys - first < LANES ? num_keys - first : LANES;
        const Chunk chunk = fetch_chunk(p, table, it->kv_begin, heads, first, n, floor, s);
        for (int h = 0; h < heads; ++h) {
            switch (padded) { /* the common head sizes get fully unrolled loops */
            case 64:
                attend_chunk(s, &chunk, h, h * per_head, per_head, pos0, group, window, 64);
                break;
            case 128:
                attend_chunk(s, &chunk, h, h * per_head, per_head, pos0, group, window, 128);
                break;
            default:
                attend_chunk(s, &chunk, h, h * per_head, per_head, pos0, group, window, padded);
            }
        }
    }

    for (int m = 0; m < num_vectors; ++m) {
        float total = 0.0f;
        for (int j = 0; j < LANES; ++j) total += s->sum[m * LANES + j];
        if (p->sinks) /* exp(sink) under the same reference as the sums; libm: may exceed 88 */
            total += expf(p->sinks[vector_head(p, it, m)] - s->ref[m]);
        const int64_t at = vector_offset(p, it, m, p->out_row, p->out_head);
        store_row(s->acc + m * padded, 1.0f / total, p->dtype, p->v_dim,
                  (char *)p->out + at * es);
    }
}

/* ---- planning ------------------------------------------------------------------------- */

static int check(const Problem *p, int *bad_seq) {
    if (p->num_seqs < 0 || p->num_heads <= 0 || p->num_kv_heads <= 0 || p->head_dim <= 0 ||
        p->window < 0 ||
        p->v_dim <= 0 || p->v_dim > p->head_dim || p->block_size <= 0 ||
        p->num_heads % p->num_kv_heads != 0)
        return PA_BAD_SHAPE;
    if (p->dtype != DTYPE_F32 && p->dtype != DTYPE_BF16 && (p->dtype != DTYPE_F16 || !HAVE_F16))
        return PA_BAD_DTYPE;
    if (p->num_seqs > 0 && p->query_start_loc[0] < 0) return PA_BAD_QUERY_LOC;
    const int64_t num_blocks = p->num_slots / p->block_size;
    for (int i = 0; i < p->num_seqs; ++i) {
        *bad_seq = i;
        const int q_len = p->query_start_loc[i + 1] - p->query_start_loc[i];
        if (q_len < 0 || p->query_start_loc[i + 1] > p->num_tokens) return PA_BAD_QUERY_LOC;
        if (q_len == 0) continue;
        if (p->seq_lens[i] < q_len) return PA_BAD_SEQ_LEN;
        const int64_t used = ((int64_t)p->seq_lens[i] + p->block_size - 1) / p->block_size;
        if (used > p->table_width) return PA_BAD_BLOCK_TABLE;
        const int32_t *table = p->block_tables + i * p->table_row;
        for (int64_t b = 0; b < used; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return PA_BAD_BLOCK_TABLE;
    }
    *bad_seq = -1;
    return PA_OK;
}

static int rows_per_tile(int group) { return group >= TILE_VECTORS ? 1 : TILE_VECTORS / group; }

static int padded_dim(int head_dim) { return (head_dim + LANES - 1) / LANES * LANES; }

/* Items of all sequences in `items` when not NULL; returns how many there are. Short tiles
 * take `heads` kv heads per item, longer ones one each. */
static int plan(const Problem *p, int heads, Item *items) {
    const int tile = rows_per_tile(p->num_heads / p->num_kv_heads);
    int count = 0;
    for (int i = 0; i < p->num_seqs; ++i) {
        const int q_len = p->query_start_loc[i + 1] - p->query_start_loc[i];
        const int step = q_len <= SHORT_TILE ? SHORT_TILE : tile;
        const int run = q_len <= SHORT_TILE ? heads : 1;
        for (int begin = 0; begin < q_len; begin += step) {
            const int end = begin + step < q_len ? begin + step : q_len;
            const int64_t keys = p->seq_lens[i] - q_len + end;
            for (int h = 0; h < p->num_kv_heads; h += run, ++count) {
                const int h_end = h + run < p->num_kv_heads ? h + run : p->num_kv_heads;
                if (items)
                    items[count] = (Item){i, h, h_end, begin, end,
                                          keys * (end - begin) * (h_end - h)};
            }
        }
    }
    return count;
}

/* kv heads per short-tile item: as many as CHUNK_BYTES allows, unless that leaves fewer than
 * four items per thread (a lone long decode must still spread over the threads). */
static int heads_per_item(const Problem *p, int num_threads) {
    const int chunk_bytes = 2 * LANES * padded_dim(p->head_dim) * (int)sizeof(float);
    int heads = CHUNK_BYTES / chunk_bytes;
    heads = heads < 1 ? 1 : (heads > p->num_kv_heads ? p->num_kv_heads : heads);
    if (heads > 1 && plan(p, heads, NULL) < 4 * num_threads) heads = 1;
    return heads;
}

static int by_cost_descending(const void *a, const void *b) {
    const int64_t ca = ((const Item *)a)->cost, cb = ((const Item *)b)->cost;
    return (ca < cb) - (ca > cb);
}

/* n floats, 64-byte aligned, zeroed (the padding columns rely on it) */
static float *alloc_floats(size_t n) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64; /* aligned_alloc needs a multiple */
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (p) memset(p, 0, bytes);
    return p;
}

static int scratch_init(Scratch *s, int max_vectors, int heads, int d) {
    s->padded = padded_dim(d);
    s->q = alloc_floats((size_t)max_vectors * s->padded);
    s->acc = alloc_floats((size_t)max_vectors * s->padded);
    s->prob = alloc_floats((size_t)max_vectors * LANES);
    s->ref = alloc_floats(max_vectors);
    s->sum = alloc_floats((size_t)max_vectors * LANES);
    s->limit = (int *)alloc_floats(max_vectors);
    s->start = (int *)alloc_floats(max_vectors);
    s->k = alloc_floats((size_t)LANES * heads * s->padded);
    s->v = alloc_floats((size_t)LANES * heads * s->padded);
    return s->q && s->acc && s->prob && s->ref && s->sum && s->limit && s->start && s->k && s->v;
}

static void scratch_free(Scratch *s) {
    free(s->q), free(s->acc), free(s->prob), free(s->ref), free(s->sum), free(s->limit);
    free(s->start);
    free(s->k), free(s->v);
}

/* ---- entry point ---------------------------------------------------------------------- */

/*
 * Returns PA_OK or a PA_* code; for a per-sequence error *bad_seq names the sequence. out is
 * untouched unless the arguments check out (on PA_NO_MEMORY it may be partly written).
 */
int raylane_paged_attention(const void *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, const int32_t *seq_lens,
                            const int32_t *query_start_loc, void *out, int64_t q_row,
                            int64_t q_head, int64_t out_row, int64_t out_head, int64_t num_slots,
                            int64_t table_row, int table_width, int num_seqs, int num_tokens,
                            int num_heads, int num_kv_heads, int head_dim, int64_t v_slot,
                            int v_dim, int block_size, float scale, int dtype, int num_threads,
                            int window, const float *sinks, int aligned, int *bad_seq) {
    const Problem p = {q, q_row, q_head, k_cache, v_cache, num_slots, block_tables, table_row,
                       table_width, seq_lens, query_start_loc, out, out_row, out_head,
                       num_seqs, num_tokens, num_heads, num_kv_heads, head_dim, block_size,
                       dtype, scale, v_slot, v_dim, window, sinks, aligned};
    *bad_seq = -1;
    const int rc = check(&p, bad_seq);
    if (rc != PA_OK) return rc;
    const int heads = heads_per_item(&p, num_threads);
    const int num_items = plan(&p, heads, NULL);
    if (num_items == 0) return PA_OK;
    Item *items = malloc(sizeof(Item) * num_items);
    if (!items) return PA_NO_MEMORY;
    plan(&p, heads, items);
    /* longest first, so a long prefill tile does not start last and leave threads idle */
    qsort(items, num_items, sizeof(Item), by_cost_descending);

    const int group = num_heads / num_kv_heads, short_vectors = SHORT_TILE * group * heads;
    const int max_vectors = rows_per_tile(group) * group > short_vectors
                                ? rows_per_tile(group) * group : short_vectors;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && num_items > 1)
    {
        Scratch s;
        const int ok = scratch_init(&s, max_vectors, heads, head_dim);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_items; ++i)
            if (ok) attend_item(&p, &items[i], &s);
        scratch_free(&s);
    }
    free(items);
    return failed ? PA_NO_MEMORY : PA_OK;
}
