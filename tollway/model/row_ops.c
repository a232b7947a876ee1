/* The row-wise operations between a decoder layer's matmuls, for the CPU.

   At batch 1 each of these is a few hundred floats, and torch spends more time dispatching
   its five-odd ops per norm than computing them. One call here does the whole operation.
   Every output row depends only on its own input row and is computed in a fixed order, so a
   row's bits never depend on what else shares the step.

   R1..R11 in comments name the measurements behind a choice: benchmarks/README.md, kernel notes. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fast_exp.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* 1 / rms(x) over n floats, accumulated in double: a fixed order, and exact enough that the
   order does not matter to the float result in practice. Eight running sums (lane i % 8), so
   the adds do not wait on one another: one chain of n dependent adds showed in a prefill (R1). */
static float inv_rms(const float *x, int64_t n, float eps) {
    double lanes[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) lanes[l] += (double)x[i + l] * x[i + l];
    for (; i < n; i++) lanes[i % 8] += (double)x[i] * x[i];
    double sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    return 1.0f / sqrtf((float)(sum / (double)n) + eps);
}

/* out[t] = x[t] / rms(x[t]) * w (w may be NULL). x rows are `stride` floats apart. */
void rms_norm(const float *x, int64_t stride, const float *w, float eps, int64_t rows, int64_t n, float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * stride;
        float *o = out + t * n;
        float r = inv_rms(xr, n, eps);
        if (w)
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r * w[i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r;
    }
}

/* The residual update and the norm that follows it, in one pass per row:
   x[t] += h_w ? rms_norm(h[t]) * h_w : h[t]   (in place)
   normed[t] = rms_norm(x[t]) * w              (skipped when normed is NULL) */
void add_rms_norm(float *x, const float *h, const float *h_w, const float *w, float eps, int64_t rows, int64_t n,
                  float *normed) {
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * n;
        const float *hr = h + t * n;
        if (h_w) {
            float r = inv_rms(hr, n, eps);
            for (int64_t i = 0; i < n; i++) xr[i] += hr[i] * r * h_w[i];
        } else {
            for (int64_t i = 0; i < n; i++) xr[i] += hr[i];
        }
        if (normed) {
            float r = inv_rms(xr, n, eps);
            float *o = normed + t * n;
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r * w[i];
        }
    }
}

/* Per-head RMS norm (w: [heads * d], or NULL for none) then rotate-half RoPE, for the q and k
   heads at the start of each qkv row. cos and sin are [positions, d / 2] tables: both halves of a
   head turn by the same angles, so x * cos + rotate_half(x) * sin takes each value twice (adding
   a product of -sin is subtracting the product of sin, exactly); out is [rows, heads, d]. */
void qk_norm_rope(const float *qkv, int64_t stride, int64_t rows, int64_t heads, int64_t d, const float *w, float eps,
                  const float *cos, const float *sin, const int64_t *positions, float *out) {
    int64_t half = d / 2;
    float buf[d];
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * half;
        const float *s = sin + positions[t] * half;
        for (int64_t j = 0; j < heads; j++) {
            const float *xr = qkv + t * stride + j * d;
            float *o = out + (t * heads + j) * d;
            if (w) {
                float r = inv_rms(xr, d, eps);
                const float *wj = w + j * d;
                for (int64_t i = 0; i < d; i++) buf[i] = xr[i] * r * wj[i];
            } else {
                memcpy(buf, xr, d * sizeof(float));
            }
            for (int64_t i = 0; i < half; i++) {
                o[i] = buf[i] * c[i] - buf[i + half] * s[i];
                o[i + half] = buf[i + half] * c[i] + buf[i] * s[i];
            }
        }
    }
}

/* out[t] = act(gate[t]) * up[t], with gate_up rows [gate (width) | up (width)].
   kind 0: GELU, tanh form, written as x * sigmoid(2u) (the same function: 1 + tanh u = 2 sigmoid 2u).
   kind 1: SiLU, x * sigmoid(x).
   The denominators go through a buffer, in a loop of their own: with exp and the division in one
   loop, gcc vectorized exp's clamps as a second, masked division, and the whole ran slower
   (the same bits either way; R2). */
enum { ACT_CHUNK = 256 };
void gated_act(const float *gate_up, int64_t rows, int64_t width, int32_t kind, float *out) {
    float den[ACT_CHUNK];
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * width;
        const float *u = g + width;
        float *o = out + t * width;
        for (int64_t i0 = 0; i0 < width; i0 += ACT_CHUNK) {
            int64_t n = width - i0 < ACT_CHUNK ? width - i0 : ACT_CHUNK;
            if (kind == 0) {
                for (int64_t i = 0; i < n; i++) {
                    float x = g[i0 + i];
                    den[i] = 1.0f + exp_poly(-1.5957691216057308f * (x + 0.044715f * x * x * x));  /* 2 sqrt(2/pi) (...) */
                }
            } else {
                for (int64_t i = 0; i < n; i++) den[i] = 1.0f + exp_poly(-g[i0 + i]);
            }
            for (int64_t i = 0; i < n; i++) o[i0 + i] = g[i0 + i] / den[i] * u[i0 + i];
        }
    }
}

/* ---- paged attention ------------------------------------------------------------------- */

typedef float v8 __attribute__((vector_size(32)));
enum { TILE = 4 };       /* query vectors sharing each key and value load */
/* Keys fetched this many positions ahead of use, into L1 (AHEAD) and into L2 (FAR; values
   too, for the value pass, which fetches VALUE_KEYS ahead itself): a sequence's keys are
   scattered over the cache's blocks, so the hardware prefetcher alone stalls on every block
   (the distances: R3). */
enum { AHEAD = 4, FAR = 8 };

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }
static inline float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

/* ---- the KV cache: float32, or IEEE half (half the bytes attention reads) ---- */

/* 8 cached floats from element `index` of a cache row (half to float is exact). */
static inline v8 kv_load8(const void *cache, int64_t index, const int half) {
    if (!half) return load8((const float *)cache + index);
#if defined(__F16C__)
    __m128i h;
    memcpy(&h, (const uint16_t *)cache + index, sizeof h);
    return (v8)_mm256_cvtph_ps(h);
#else
    v8 v;
    for (int i = 0; i < 8; i++) v[i] = (float)((const _Float16 *)cache + index)[i];
    return v;
#endif
}

static inline const void *kv_at(const void *cache, int64_t index, const int half) {
    return (const char *)cache + index * (half ? 2 : 4);
}

static void store_row(void *cache, int64_t index, const float *src, int64_t n, int half) {
    if (!half) {
        memcpy((float *)cache + index, src, n * sizeof(float));
        return;
    }
    /* IEEE rounding to nearest even, as torch's .half(); n is a multiple of 16 (whole heads) */
#if defined(__F16C__)
    for (int64_t i = 0; i < n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        memcpy((uint16_t *)cache + index + i, &h, sizeof h);
    }
#else
    for (int64_t i = 0; i < n; i++) ((_Float16 *)cache)[index + i] = (_Float16)src[i];
#endif
}

/* Writes the step's new keys and values to their cache slots (half: as IEEE half). */
void write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, int64_t tokens, int64_t row,
              const int64_t *slots, void *k_cache, void *v_cache, int32_t half) {
    for (int64_t t = 0; t < tokens; t++) {
        store_row(k_cache, slots[t] * row, k + t * k_stride, row, half);
        store_row(v_cache, slots[t] * row, v + t * v_stride, row, half);
    }
}

/* Values summed per pass: VALUE_COLS columns of each of the tile's vectors, kept in registers,
   over VALUE_KEYS keys. QK_KEYS: keys whose scores are summed together, each with the tile's
   query vectors. Both as wide as the registers allow (AVX-512 has 32 of them): wider took
   attention less time, decode and prefill alike, with the same bits (R4). The value pass runs in
   vectors of VALUE_LANES floats: a column's sum is the same float in any width, and 16 lanes a
   vector halved the broadcasts and address steps per multiply-add (R12). */
#if defined(__AVX512F__)
enum { VALUE_COLS = 64, VALUE_LANES = 16 };
#define QK_KEYS 4
typedef float vvalue __attribute__((vector_size(64)));

static inline vvalue kv_load_value(const void *cache, int64_t index, const int half) {
    vvalue v;
    if (!half) {
        memcpy(&v, (const float *)cache + index, sizeof v);
        return v;
    }
    __m256i h;
    memcpy(&h, (const uint16_t *)cache + index, sizeof h);
    return (vvalue)_mm512_cvtph_ps(h);
}
#else
enum { VALUE_COLS = 16, VALUE_LANES = 8 };
#define QK_KEYS 2
typedef v8 vvalue;
#define kv_load_value kv_load8
#endif
enum { VALUE_KEYS = 16 };

static inline vvalue load_value_sums(const float *p) { vvalue v; memcpy(&v, p, sizeof v); return v; }
static inline void store_value_sums(float *p, vvalue v) { memcpy(p, &v, sizeof v); }

typedef float v4 __attribute__((vector_size(16)));

/* score[i][u] = hsum8(acc[u][i]) * scale. With four keys, their sums are reduced together, the
   pairs added in hsum8's order, so each is the same float. */
static inline __attribute__((always_inline)) void key_sums(v8 acc[QK_KEYS][TILE], const int tile, float scale,
                                                           float score[TILE][QK_KEYS]) {
    for (int i = 0; i < tile; i++) {
#if QK_KEYS == 4
        v4 p[4];
        for (int u = 0; u < 4; u++)
            p[u] = __builtin_shufflevector(acc[u][i], acc[u][i], 0, 1, 2, 3) +
                   __builtin_shufflevector(acc[u][i], acc[u][i], 4, 5, 6, 7);  /* v0+v4 .. v3+v7 */
        v4 h01 = __builtin_shufflevector(p[0], p[1], 0, 2, 4, 6) + __builtin_shufflevector(p[0], p[1], 1, 3, 5, 7);
        v4 h23 = __builtin_shufflevector(p[2], p[3], 0, 2, 4, 6) + __builtin_shufflevector(p[2], p[3], 1, 3, 5, 7);
        v4 r = (__builtin_shufflevector(h01, h23, 0, 2, 4, 6) + __builtin_shufflevector(h01, h23, 1, 3, 5, 7)) * scale;
        for (int u = 0; u < 4; u++) score[i][u] = r[u];
#else
        for (int u = 0; u < QK_KEYS; u++) score[i][u] = hsum8(acc[u][i]) * scale;
#endif
    }
}

/* sums[i][c, c + width) += weights[i * stride + j] * value row j, for keys j0..j1 in order. */
static inline __attribute__((always_inline)) void value_pass(
        const void *v_cache, const int64_t *rows, const float *weights, int64_t span, int64_t stride, int64_t j0,
        int64_t j1, int64_t d, int64_t c, float (*sums)[d], const int half, const int tile, const int width) {
    enum { L = VALUE_LANES };
    vvalue acc[TILE][VALUE_COLS / L];
    for (int i = 0; i < tile; i++)
        for (int u = 0; u < width / L; u++) acc[i][u] = load_value_sums(sums[i] + c + L * u);
    for (int64_t j = j0; j < j1; j++) {
        int64_t value = rows[j] * d + c;
        if (j + VALUE_KEYS < span)
            for (int line = 0; line < width * (half ? 2 : 4); line += 64)
                __builtin_prefetch((const char *)kv_at(v_cache, rows[j + VALUE_KEYS] * d + c, half) + line);
        vvalue x[VALUE_COLS / L];
        for (int u = 0; u < width / L; u++) x[u] = kv_load_value(v_cache, value + L * u, half);
        for (int i = 0; i < tile; i++) {
            float p = weights[i * stride + j];
            for (int u = 0; u < width / L; u++) acc[i][u] += p * x[u];
        }
    }
    for (int i = 0; i < tile; i++)
        for (int u = 0; u < width / L; u++) store_value_sums(sums[i] + c + L * u, acc[i][u]);
}

/* The next sequence's keys and values, fetched into L2 while this one's last tile runs, a few
   lines at a time: the prefetches above work within a sequence, so each sequence started on a
   miss, and its value pass, reading L2, left memory idle. At most LOOKAHEAD_BYTES, so that a long
   sequence's fetches do not evict the current one's (R5). */
enum { LOOKAHEAD_BYTES = 128 * 1024 };

typedef struct {
    const char *k, *v;
    const int64_t *table;         /* the next sequence's blocks */
    int64_t pos, end;             /* its positions not yet fetched */
    int64_t offset;               /* bytes fetched of the run of positions from pos in its block */
    int64_t block_size, row_bytes; /* row_bytes: a position's keys, every KV head */
} lookahead;

static inline void fetch_ahead(lookahead *a, int64_t lines) {
    while (lines > 0 && a->pos < a->end) {
        int64_t in = a->pos % a->block_size;
        int64_t n = a->block_size - in < a->end - a->pos ? a->block_size - in : a->end - a->pos;
        int64_t base = (a->table[a->pos / a->block_size] * a->block_size + in) * a->row_bytes, bytes = n * a->row_bytes;
        for (; a->offset < bytes && lines > 0; a->offset += 64, lines--) {
            __builtin_prefetch(a->k + base + a->offset, 0, 1);
            __builtin_prefetch(a->v + base + a->offset, 0, 1);
        }
        if (a->offset >= bytes) a->pos += n, a->offset = 0;
    }
}

/* The first key position a query at `position` reads: window 0 reads from 0. */
static inline int64_t first_key(int64_t position, int64_t window) {
    return window && position - window + 1 > 0 ? position - window + 1 : 0;
}

/* out[i][c0, c1) = the tile's value sums over their softmax totals, for the vectors it outputs. */
static inline void divide_sums(float *const *ov, int64_t d, float (*sums)[d], const float *total, int64_t c0,
                               int64_t c1) {
    for (int i = 0; i < TILE; i++) {
        if (!ov[i]) continue;
        for (int64_t c = c0; c < c1; c += 8) store8(ov[i] + c, load8(sums[i] + c) / total[i]);
    }
}

/* rows[j] = the cache row of KV head g's key at position first + j, for j < span, through the
   sequence's block table: a block at a time, for a division per key slowed attention (R6). */
static void key_rows(const int64_t *table, int64_t first, int64_t span, int64_t block_size, int64_t kv_heads,
                     int64_t g, int64_t *rows) {
    for (int64_t j = 0, pos = first; j < span;) {
        int64_t offset = pos % block_size, base = table[pos / block_size] * block_size + offset;
        int64_t n = block_size - offset < span - j ? block_size - offset : span - j;
        for (int64_t k = 0; k < n; k++) rows[j + k] = (base + k) * kv_heads + g;
        j += n, pos += n;
    }
}

/* Scores of a tile's query vectors qv[i] against keys j0..j1 of `rows` (0 <= j0 < j1 <= span), into
   weights[i * stride + j]: scaled, capped, and -INFINITY outside the vector's own positions
   [lo[i], hi[i]] (key j is position tile_lo + j). A key's score never depends on the keys scored
   beside it, so any slice of the keys gives each the same float. */
static inline __attribute__((always_inline)) void score_keys(
        const float *const *qv, const int64_t *rows, int64_t j0, int64_t j1, int64_t stride, int64_t d,
        const void *k_cache, const void *v_cache, float scale, float softcap, int64_t tile_lo, const int64_t *lo,
        const int64_t *hi, float *weights, lookahead *next, int64_t per_step, const int half, const int tile) {
    int64_t all_lo = lo[0], all_hi = hi[0];  /* the positions every vector of the tile reads */
    for (int i = 1; i < tile; i++) {
        all_lo = lo[i] > all_lo ? lo[i] : all_lo;
        all_hi = hi[i] < all_hi ? hi[i] : all_hi;
    }
    /* QK_KEYS keys at a time: each query load serves them all, and the sums in flight keep the FMA
       units busy where four waited on one another (R7). */
    for (int64_t j = j0; j < j1; j += QK_KEYS) {
        int64_t key[QK_KEYS], ahead[QK_KEYS], far[QK_KEYS];
        for (int u = 0; u < QK_KEYS; u++) {
            int64_t ju = j + u < j1 ? j + u : j;
            key[u] = rows[ju] * d;
            /* later keys' rows, one cache line per line of these */
            ahead[u] = rows[ju + AHEAD < j1 ? ju + AHEAD : ju] * d;
            far[u] = rows[ju + FAR < j1 ? ju + FAR : ju] * d;
        }
        v8 acc[QK_KEYS][TILE];
        for (int u = 0; u < QK_KEYS; u++)
            for (int i = 0; i < tile; i++) acc[u][i] = (v8){0};
        for (int64_t c = 0; c < d; c += 8) {
            if (c % (half ? 32 : 16) == 0) {
                for (int u = 0; u < QK_KEYS; u++) {
                    __builtin_prefetch(kv_at(k_cache, ahead[u] + c, half));
                    /* and into L2 further ahead, the key and its value for the value pass: both
                       streams in flight at once (R8) */
                    __builtin_prefetch(kv_at(k_cache, far[u] + c, half), 0, 1);
                    __builtin_prefetch(kv_at(v_cache, far[u] + c, half), 0, 1);
                }
            }
            v8 k[QK_KEYS];
            for (int u = 0; u < QK_KEYS; u++) k[u] = kv_load8(k_cache, key[u] + c, half);
            /* The queries in registers: gcc folds their loads into the FMAs, QK_KEYS loads each,
               and then the loads, not the FMAs, set the pace (R9). */
            v8 qc[TILE];
            for (int i = 0; i < tile; i++) {
                qc[i] = load8(qv[i] + c);
#if defined(__AVX__)  /* 8 floats fit one register only from AVX on: an SSE-only build has none to ask for */
                __asm__("" : "+v"(qc[i]));
#endif
            }
            for (int i = 0; i < tile; i++)
                for (int u = 0; u < QK_KEYS; u++) acc[u][i] += qc[i] * k[u];
        }
        fetch_ahead(next, per_step);
        float score[TILE][QK_KEYS];
        key_sums(acc, tile, scale, score);
        if (softcap == 0.0f && j + QK_KEYS <= j1 && tile_lo + j >= all_lo && tile_lo + j + QK_KEYS - 1 <= all_hi) {
            /* Keys every vector reads, uncapped, as most of a prefill's are: stored without the
               per-score tests (R14). */
            for (int i = 0; i < tile; i++)
                for (int u = 0; u < QK_KEYS; u++) weights[i * stride + j + u] = score[i][u];
            continue;
        }
        for (int u = 0; u < QK_KEYS && j + u < j1; u++) {
            for (int i = 0; i < tile; i++) {
                float s = score[i][u];
                if (softcap != 0.0f) {
                    /* tanh(x) = 2 sigmoid(2x) - 1 */
                    s = softcap * (2.0f / (1.0f + exp_poly(-2.0f * s / softcap)) - 1.0f);
                }
                int64_t pos = tile_lo + j + u;
                weights[i * stride + j + u] = pos >= lo[i] && pos <= hi[i] ? s : -INFINITY;
            }
        }
    }
}

/* Softmax: each vector's scores [0, span) become their numerators in place, and total[i] their
   sum; the exponentials one loop (it vectorizes), each vector's sum another, in position order,
   the tile's sums interleaved so they do not wait on one another. */
static inline __attribute__((always_inline)) void softmax_numerators(float *weights, int64_t span, int64_t stride,
                                                                     float *total, const int tile) {
    for (int i = 0; i < tile; i++) {
        float *w = weights + i * stride, m = -INFINITY;
        /* The maximum in 8 lanes: one running maximum waited on each compare (R13). The same
           float whatever the order, scores being never NaN. */
        float lanes[8] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY, -INFINITY};
        int64_t j = 0;
        for (; j + 8 <= span; j += 8)
            for (int u = 0; u < 8; u++) lanes[u] = w[j + u] > lanes[u] ? w[j + u] : lanes[u];
        for (int u = 0; u < 8; u++) m = lanes[u] > m ? lanes[u] : m;
        for (; j < span; j++) m = w[j] > m ? w[j] : m;
        for (int64_t j = 0; j < span; j++) w[j] = w[j] == -INFINITY ? 0.0f : exp_poly(w[j] - m);
        total[i] = 0.0f;
    }
    for (int64_t j = 0; j < span; j++)
        for (int i = 0; i < tile; i++) total[i] += weights[i * stride + j];
}

/* sums[i][c0, c1) = the tile's numerators times the value rows of keys 0..span, summed per column
   in position order (c0 and c1 multiples of 16). Values VALUE_KEYS keys at a time: their rows stay
   in L1 across the column passes while each pass fetches the next group's line, and a pass's sums
   stay in registers across the group. A column's sum is the same float whatever the passes' width. */
static inline __attribute__((always_inline)) void value_sums(
        const void *v_cache, const int64_t *rows, const float *weights, int64_t span, int64_t stride, int64_t d,
        int64_t c0, int64_t c1, float (*sums)[d], lookahead *next, int64_t per_step, const int half, const int tile) {
    for (int i = 0; i < tile; i++) memset(sums[i] + c0, 0, sizeof(float) * (c1 - c0));
    for (int64_t j0 = 0; j0 < span; j0 += VALUE_KEYS) {
        int64_t j1 = j0 + VALUE_KEYS < span ? j0 + VALUE_KEYS : span;
        fetch_ahead(next, per_step);
        int64_t c = c0;
        for (; c + VALUE_COLS <= c1; c += VALUE_COLS)
            value_pass(v_cache, rows, weights, span, stride, j0, j1, d, c, sums, half, tile, VALUE_COLS);
        for (; c < c1; c += 16) value_pass(v_cache, rows, weights, span, stride, j0, j1, d, c, sums, half, tile, 16);
    }
}

/* Attention's two buffers (key rows; scores and numerators), kept per thread between calls up to
   KEPT_SCRATCH_BYTES each: a decode step allocated and freed them once a layer, each time with
   the consolidation of the small blocks Python frees (R10). A larger buffer, a long sequence's,
   is the caller's own and freed when given back. NULL when memory ran out. A thread's kept
   buffers are freed when it exits (each exited thread had left them resident). */
enum { SCRATCH_ROWS, SCRATCH_SCORES, SCRATCH_KINDS };
enum { KEPT_SCRATCH_BYTES = 1 << 20 };
static __thread void *kept_scratch[SCRATCH_KINDS];
static pthread_key_t scratch_owner;  /* its destructor gets the exiting thread's kept_scratch */
static pthread_once_t scratch_owner_once = PTHREAD_ONCE_INIT;

static void free_kept_scratch(void *kept) {
    for (int kind = 0; kind < SCRATCH_KINDS; kind++) free(((void **)kept)[kind]);
}

static void make_scratch_owner(void) { pthread_key_create(&scratch_owner, free_kept_scratch); }

static void *take_scratch(int kind, size_t bytes) {
    if (bytes > KEPT_SCRATCH_BYTES) return malloc(bytes);
    if (!kept_scratch[kind]) {
        pthread_once(&scratch_owner_once, make_scratch_owner);
        pthread_setspecific(scratch_owner, kept_scratch);
        kept_scratch[kind] = malloc(KEPT_SCRATCH_BYTES);
    }
    return kept_scratch[kind];
}

static void give_scratch(int kind, void *buffer) {
    if (buffer != kept_scratch[kind]) free(buffer);
}

/* Causal attention of each token's query heads over its sequence's cached keys, read through
   its block table: positions [max(0, p - window + 1), p] (window 0: [0, p]). Token t uses
   table row table_rows[t]; q rows are q_stride floats apart, head h at h * d; out is
   [tokens, heads, d]. d must be a multiple of 16.

   Query vectors of one sequence and KV head are taken TILE at a time so that each key and
   value is loaded once per tile. A vector's result does not depend on its tile: its scores
   are its own dot products, and keys outside its range weigh exactly 0, so its sums run over
   its own keys in position order whatever the tile's combined range. */
static inline __attribute__((always_inline)) void attend(
        const float *q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
        const void *k_cache, const void *v_cache, const int64_t *tables, int64_t table_width,
        const int64_t *table_rows, const int64_t *positions, int64_t block_size, int64_t window, float scale,
        float softcap, float *out, const int half) {
    const int tile = TILE;
    int64_t group = heads / kv_heads;
    float sums[TILE][d];     /* value sums of the tile's vectors */
    float *weights = NULL;   /* [TILE][span]: scores, then softmax numerators */
    int64_t *rows = NULL;    /* [span]: cache row of each key position */
    int64_t capacity = 0;
    for (int64_t first = 0; first < tokens;) {
        int64_t end = first + 1;
        while (end < tokens && table_rows[end] == table_rows[first]) end++;
        const int64_t *table = tables + table_rows[first] * table_width;
        int64_t vectors = (end - first) * group;
        for (int64_t g = 0; g < kv_heads; g++) {
            for (int64_t v0 = 0; v0 < vectors; v0 += tile) {
                const float *qv[TILE];
                float *ov[TILE];
                int64_t lo[TILE], hi[TILE], tile_lo = INT64_MAX, tile_hi = 0;
                for (int i = 0; i < tile; i++) {
                    int64_t vi = v0 + i < vectors ? v0 + i : vectors - 1;  /* padding repeats the last */
                    int64_t t = first + vi / group, h = g * group + vi % group;
                    qv[i] = q + t * q_stride + h * d;
                    ov[i] = v0 + i < vectors ? out + (t * heads + h) * d : NULL;
                    hi[i] = positions[t];
                    lo[i] = first_key(hi[i], window);
                    tile_lo = lo[i] < tile_lo ? lo[i] : tile_lo;
                    tile_hi = hi[i] > tile_hi ? hi[i] : tile_hi;
                }
                int64_t span = tile_hi - tile_lo + 1;
                if (span > capacity) {
                    give_scratch(SCRATCH_SCORES, weights);
                    give_scratch(SCRATCH_ROWS, rows);
                    capacity = span * 2;
                    weights = take_scratch(SCRATCH_SCORES, sizeof(float) * tile * capacity);
                    rows = take_scratch(SCRATCH_ROWS, sizeof(int64_t) * capacity);
                }
                key_rows(table, tile_lo, span, block_size, kv_heads, g, rows);
                /* The last tile of a sequence fetches the next one's. */
                lookahead next = {0};
                int64_t per_step = 0;
                if (end < tokens && g == kv_heads - 1 && v0 + tile >= vectors) {
                    int64_t row_bytes = kv_heads * d * (half ? 2 : 4), last = end;
                    while (last + 1 < tokens && table_rows[last + 1] == table_rows[end]) last++;
                    int64_t start = first_key(positions[end], window);
                    int64_t stop = positions[last] + 1;
                    stop = (stop - start) * row_bytes > LOOKAHEAD_BYTES ? start + LOOKAHEAD_BYTES / row_bytes : stop;
                    next = (lookahead){(const char *)k_cache, (const char *)v_cache, tables + table_rows[end] * table_width,
                                       start, stop, 0, block_size, row_bytes};
                    int64_t lines = ((stop - start) * row_bytes + 63) / 64, steps = span / QK_KEYS + span / VALUE_KEYS + 2;
                    per_step = (lines + steps - 1) / steps;
                }
                score_keys(qv, rows, 0, span, span, d, k_cache, v_cache, scale, softcap, tile_lo, lo, hi, weights, &next,
                           per_step, half, tile);
                float total[TILE];
                softmax_numerators(weights, span, span, total, tile);
                value_sums(v_cache, rows, weights, span, span, d, 0, d, sums, &next, per_step, half, tile);
                divide_sums(ov, d, sums, total, 0, d);
            }
        }
        first = end;
    }
    give_scratch(SCRATCH_SCORES, weights);
    give_scratch(SCRATCH_ROWS, rows);
}

/* half: the cache holds IEEE half (write_kv's), else float32: one body, specialized for each. */
static void attend_part(const float *q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                        const void *k_cache, const void *v_cache, const int64_t *tables, int64_t table_width,
                        const int64_t *table_rows, const int64_t *positions, int64_t block_size, int64_t window,
                        float scale, float softcap, float *out, int32_t half) {
    if (half)
        attend(q, q_stride, tokens, heads, kv_heads, d, k_cache, v_cache, tables, table_width, table_rows, positions,
               block_size, window, scale, softcap, out, 1);
    else
        attend(q, q_stride, tokens, heads, kv_heads, d, k_cache, v_cache, tables, table_width, table_rows, positions,
               block_size, window, scale, softcap, out, 0);
}

void paged_attention(const float *q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t kv_heads, int64_t d,
                     const void *k_cache, const void *v_cache, const int64_t *tables, int64_t table_width,
                     const int64_t *table_rows, const int64_t *positions, int64_t block_size, int64_t window,
                     float scale, float softcap, float *out, int32_t half) {
    attend_part(q, q_stride, tokens, heads, kv_heads, d, k_cache, v_cache, tables, table_width, table_rows, positions,
                block_size, window, scale, softcap, out, half);
}

/* ---- attention on the matmuls' thread pool ---------------------------------------------- */

/* The pool lives in qmatmul.c (a separate library, compiled for every instruction set); its
   q8_parallel is passed in, so a step's matmuls and the operations between them share threads. */
typedef void (*task_fn)(void *ctx, int part, int parts);
typedef void (*parallel_fn)(int threads, task_fn fn, void *ctx);

/* Attention with at least this many (token, key) pairs is split over the threads; fewer tokens
   than threads share them from this many (R11). */
enum { PARALLEL_ATTENTION_PAIRS = 4096, SHARED_ATTENTION_PAIRS = 64 };

typedef struct {
    const float *q;
    int64_t q_stride, tokens, heads, kv_heads, d;
    const void *k_cache, *v_cache;
    const int64_t *tables;
    int64_t table_width;
    const int64_t *table_rows, *positions;
    int64_t block_size, window;
    float scale, softcap;
    float *out;
    int32_t half;
} attention_job;

static int64_t keys_read(const attention_job *j, int64_t t) {
    return j->positions[t] - first_key(j->positions[t], j->window) + 1;
}

/* Part p takes the tokens from where the keys read before them reach p / parts of the total,
   so parts get equal work. A token's result never depends on which part ran it. */
static void attention_part(void *ctx, int part, int parts) {
    const attention_job *j = ctx;
    int64_t total = 0, done = 0, first = -1, last = j->tokens;
    for (int64_t t = 0; t < j->tokens; t++) total += keys_read(j, t);
    for (int64_t t = 0; t < j->tokens; t++) {
        if (first < 0 && done * parts >= total * part) first = t;
        if (done * parts >= total * (part + 1)) {
            last = t;
            break;
        }
        done += keys_read(j, t);
    }
    if (first < 0 || last <= first) return;
    attend_part(j->q + first * j->q_stride, j->q_stride, last - first, j->heads, j->kv_heads, j->d, j->k_cache,
                j->v_cache, j->tables, j->table_width, j->table_rows + first, j->positions + first, j->block_size,
                j->window, j->scale, j->softcap, j->out + first * j->heads * j->d, j->half);
}

/* Fewer tokens than threads (a lone decode): the threads share each token's keys without reading
   any twice. First each part scores a slice of the keys, for every query vector of their KV head
   (a tile of TILE, the last padded); then each part takes a slice of the value columns, over
   every key, after its own softmax of all the scores. Every score and every column's sum is the
   float one thread gets, in the same order, so the tokens never depend on the thread count.
   Where the threads had shared the query vectors instead, each reading every key, a Gemma 3
   decode's attention took longer, the more so the longer the context: each thread then read all
   the keys. */
typedef struct {
    const attention_job *j;
    int64_t stride;      /* the longest token's key count: the buffers' row length */
    int64_t tiles;       /* tiles of query vectors per KV head */
    const int64_t *rows; /* [tokens][kv_heads][stride]: each key's cache row */
    float *scores;       /* [tokens][kv_heads][tiles * TILE][stride] */
    float *weights;      /* [parts][TILE][stride]: each part's softmax numerators */
} shared_job;

/* The tile's query vectors (the last repeated past the group) and their outputs (NULL there). */
static void tile_vectors(const attention_job *j, int64_t t, int64_t g, int64_t v0, const float *qv[TILE],
                         float *ov[TILE]) {
    int64_t group = j->heads / j->kv_heads;
    for (int i = 0; i < TILE; i++) {
        int64_t h = g * group + (v0 + i < group ? v0 + i : group - 1);
        qv[i] = j->q + t * j->q_stride + h * j->d;
        ov[i] = v0 + i < group ? j->out + (t * j->heads + h) * j->d : NULL;
    }
}

/* One phase of a part: the scores of its slice of the keys, or (values) the sums of its slice of
   the value columns. */
static inline __attribute__((always_inline)) void shared_phase(const shared_job *s, int part, int parts,
                                                               const int values, const int half) {
    const attention_job *j = s->j;
    int64_t d = j->d, pieces = d / 16, c0 = pieces * part / parts * 16, c1 = pieces * (part + 1) / parts * 16;
    if (values && c0 == c1) return;
    lookahead none = {0};
    float sums[TILE][d], total[TILE], *weights = s->weights + part * TILE * s->stride;
    for (int64_t t = 0; t < j->tokens; t++) {
        int64_t hi = j->positions[t], lo = first_key(hi, j->window), los[TILE], his[TILE];
        int64_t span = hi - lo + 1, j0 = span * part / parts, j1 = span * (part + 1) / parts;
        if (!values && j0 == j1) continue;
        for (int i = 0; i < TILE; i++) los[i] = lo, his[i] = hi;
        for (int64_t g = 0; g < j->kv_heads; g++) {
            const int64_t *rows = s->rows + (t * j->kv_heads + g) * s->stride;
            for (int64_t tile = 0; tile < s->tiles; tile++) {
                const float *qv[TILE];
                float *ov[TILE];
                tile_vectors(j, t, g, tile * TILE, qv, ov);
                float *scores = s->scores + ((t * j->kv_heads + g) * s->tiles + tile) * TILE * s->stride;
                if (!values) {
                    score_keys(qv, rows, j0, j1, s->stride, d, j->k_cache, j->v_cache, j->scale, j->softcap, lo, los,
                               his, scores, &none, 0, half, TILE);
                    continue;
                }
                memcpy(weights, scores, sizeof(float) * TILE * s->stride);
                softmax_numerators(weights, span, s->stride, total, TILE);
                value_sums(j->v_cache, rows, weights, span, s->stride, d, c0, c1, sums, &none, 0, half, TILE);
                divide_sums(ov, d, sums, total, c0, c1);
            }
        }
    }
}

static void shared_scores_part(void *ctx, int part, int parts) {
    const shared_job *s = ctx;
    if (s->j->half) shared_phase(s, part, parts, 0, 1); else shared_phase(s, part, parts, 0, 0);
}

static void shared_values_part(void *ctx, int part, int parts) {
    const shared_job *s = ctx;
    if (s->j->half) shared_phase(s, part, parts, 1, 1); else shared_phase(s, part, parts, 1, 0);
}

static void run_shared(const attention_job *j, parallel_fn parallel, int threads) {
    int64_t stride = 0, group = j->heads / j->kv_heads, tiles = (group + TILE - 1) / TILE;
    for (int64_t t = 0; t < j->tokens; t++) stride = keys_read(j, t) > stride ? keys_read(j, t) : stride;
    int64_t *rows = take_scratch(SCRATCH_ROWS, sizeof(int64_t) * j->tokens * j->kv_heads * stride);
    float *scores = take_scratch(SCRATCH_SCORES, sizeof(float) * (j->tokens * j->kv_heads * tiles + threads) * TILE * stride);
    if (!rows || !scores) {  /* out of memory: one thread, which needs less */
        give_scratch(SCRATCH_ROWS, rows);
        give_scratch(SCRATCH_SCORES, scores);
        attention_part((void *)j, 0, 1);
        return;
    }
    for (int64_t t = 0; t < j->tokens; t++) {
        int64_t hi = j->positions[t], lo = first_key(hi, j->window);
        for (int64_t g = 0; g < j->kv_heads; g++)
            key_rows(j->tables + j->table_rows[t] * j->table_width, lo, hi - lo + 1, j->block_size, j->kv_heads, g,
                     rows + (t * j->kv_heads + g) * stride);
    }
    shared_job s = {j, stride, tiles, rows, scores, scores + j->tokens * j->kv_heads * tiles * TILE * stride};
    parallel(threads, shared_scores_part, &s);
    parallel(threads, shared_values_part, &s);
    give_scratch(SCRATCH_ROWS, rows);
    give_scratch(SCRATCH_SCORES, scores);
}

static void run_attention(const attention_job *j, parallel_fn parallel, int threads) {
    int64_t pairs = 0;
    for (int64_t t = 0; t < j->tokens; t++) pairs += keys_read(j, t);
    if (threads > 1 && j->tokens < threads && pairs >= SHARED_ATTENTION_PAIRS)
        run_shared(j, parallel, threads);
    else if (threads > 1 && j->tokens >= threads && pairs >= PARALLEL_ATTENTION_PAIRS)
        parallel(threads, attention_part, (void *)j);
    else
        attention_part((void *)j, 0, 1);
}

/* paged_attention over `threads` threads of the pool (parallel is qmatmul.c's q8_parallel). */
void paged_attention_parallel(const float *q, int64_t q_stride, int64_t tokens, int64_t heads, int64_t kv_heads,
                              int64_t d, const void *k_cache, const void *v_cache, const int64_t *tables,
                              int64_t table_width, const int64_t *table_rows, const int64_t *positions,
                              int64_t block_size, int64_t window, float scale, float softcap, float *out,
                              int32_t half, parallel_fn parallel, int32_t threads) {
    attention_job j = {q, q_stride, tokens, heads, kv_heads, d, k_cache, v_cache, tables, table_width, table_rows,
                       positions, block_size, window, scale, softcap, out, half};
    run_attention(&j, parallel, threads);
}

/* ---- a step's decoder layers in one call ------------------------------------------------
   The same operations, in the same order, as the layer classes run one call at a time
   (gemma3.py, llama.py), so the result is the same to the bit: what goes is the Python and
   ctypes between them, about 10 calls a layer, which at batch 1 costs more than the
   operations themselves. The matmuls are qmatmul.c's, passed in as function pointers. */

typedef int (*matmul_fn)(const float *x, int64_t ldx, int64_t m, int64_t k, const void *packed, int64_t n, float *y,
                         int64_t ldy, int32_t isa, int32_t threads);
typedef int (*argmax_fn)(const float *x, int64_t ldx, int64_t m, int64_t k, const void *packed, int64_t n,
                         int64_t *argmax, int32_t isa, int32_t threads);

typedef struct {
    matmul_fn matmul;  /* q8_matmul, q4_matmul or q5_matmul */
    const void *packed;
    const float *bias;  /* [n] or NULL */
    int64_t n, k;
} linear;

/* Mirrored by native_layers.py's ctypes structures: keep the two in step. */
typedef struct {
    linear qkv, o, gate_up, down;
    /* Gemma's sandwich: x += post_attn(o); normed = pre_ff(x); x += post_ff(down). A pre-norm
       (Llama) block has no post norms: x += o; normed = pre_ff(x); x += down. */
    const float *input_norm, *post_attn_norm, *pre_ff_norm, *post_ff_norm;
    const float *qk_norm;  /* [heads + kv_heads, d] or NULL */
    const float *cos, *sin;
    void *k_cache, *v_cache;
    int64_t heads, kv_heads, head_dim, width, window;
    float eps, scale, softcap;
    int32_t activation;
    int32_t kv_half;  /* the caches hold IEEE half */
} layer;

typedef struct {
    int64_t tokens, hidden;
    const int64_t *positions, *slots, *tables, *table_rows;
    int64_t table_width, block_size;
    /* The rows whose output the caller reads (their indices ascending, with their positions and
       table rows), or keep NULL for all: the last layer runs only its K and V for the others. */
    int64_t kept;
    const int64_t *keep, *kept_positions, *kept_table_rows;
    /* scratch, [tokens, ...] each: normed [hidden], qkv [qkv.n], qk [heads + kv_heads, d],
       attn [heads * d], h [hidden], gate_up [2 * width], act [width] */
    float *normed, *qkv, *qk, *attn, *h, *gate_up, *act;
    parallel_fn parallel;
    int32_t isa, threads;
    /* A step may stop between two layers, to be run on from there by a later call: it starts at
       first_layer, and stops after a layer once *yield_flag is non-zero (another thread sets it:
       a fast request arrived) or CLOCK_MONOTONIC has passed yield_at_ns (0: never). */
    int64_t first_layer;
    const int32_t *yield_flag;  /* or NULL */
    int64_t yield_at_ns;
} step;

/* The model's two ends, for a greedy step run whole in one call (decoder_greedy): the embedding
   rows (times embed_scale where not NULL), and the final norm and the LM head's argmax. */
typedef int (*embed_rows_fn)(int type, const uint8_t *table, int64_t row_bytes, int64_t k, const int64_t *ids,
                            int64_t n, const float *scale, float *out, int64_t ldo);
typedef struct {
    embed_rows_fn embed_rows;  /* qmatmul.c's gguf_rows: the table's rows decoded from its GGUF type */
    const uint8_t *embed;
    int64_t embed_row_bytes;
    int32_t embed_type;
    const float *embed_scale;
    const float *final_norm;
    float eps;
    argmax_fn argmax;  /* the head's format's kind_matmul_argmax */
    const void *head;
    int64_t vocab;
} ends;

/* Row-wise work is split over the threads from this many rows. */
enum { PARALLEL_ROWS = 16 };

enum { OP_INPUT_NORM, OP_QK_ROPE_KV, OP_ATTENTION_RESIDUAL, OP_GATED, OP_MLP_RESIDUAL };

typedef struct {
    int op;
    const layer *l;
    const step *s;
    float *x;
} rows_job;

static void rows_part(void *ctx, int part, int parts) {
    const rows_job *j = ctx;
    const layer *l = j->l;
    const step *s = j->s;
    int64_t t0 = s->tokens * part / parts, n = s->tokens * (part + 1) / parts - t0, hidden = s->hidden;
    int64_t d = l->head_dim, qk_heads = l->heads + l->kv_heads;
    if (n <= 0) return;
    switch (j->op) {
        case OP_INPUT_NORM:
            rms_norm(j->x + t0 * hidden, hidden, l->input_norm, l->eps, n, hidden, s->normed + t0 * hidden);
            break;
        case OP_QK_ROPE_KV: {
            float *qk = s->qk + t0 * qk_heads * d;
            const float *qkv = s->qkv + t0 * l->qkv.n;
            qk_norm_rope(qkv, l->qkv.n, n, qk_heads, d, l->qk_norm, l->eps, l->cos, l->sin, s->positions + t0,
                         qk);
            write_kv(qk + l->heads * d, qk_heads * d, qkv + qk_heads * d, l->qkv.n, n, l->kv_heads * d, s->slots + t0,
                     l->k_cache, l->v_cache, l->kv_half);
            break;
        }
        case OP_ATTENTION_RESIDUAL:
            add_rms_norm(j->x + t0 * hidden, s->h + t0 * hidden, l->post_attn_norm, l->pre_ff_norm, l->eps, n, hidden,
                         s->normed + t0 * hidden);
            break;
        case OP_GATED:
            gated_act(s->gate_up + t0 * 2 * l->width, n, l->width, l->activation, s->act + t0 * l->width);
            break;
        case OP_MLP_RESIDUAL:
            add_rms_norm(j->x + t0 * hidden, s->h + t0 * hidden, l->post_ff_norm, NULL, l->eps, n, hidden, NULL);
            break;
    }
}

static void run_rows(int op, const layer *l, const step *s, float *x) {
    rows_job j = {op, l, s, x};
    if (s->threads > 1 && s->tokens >= PARALLEL_ROWS)
        s->parallel(s->threads, rows_part, &j);
    else
        rows_part(&j, 0, 1);
}

static int run_linear(const linear *lin, const step *s, const float *x, float *y) {
    if (lin->matmul(x, lin->k, s->tokens, lin->k, lin->packed, lin->n, y, lin->n, s->isa, s->threads)) return -1;
    if (lin->bias)
        for (int64_t t = 0; t < s->tokens; t++)
            for (int64_t i = 0; i < lin->n; i++) y[t * lin->n + i] += lin->bias[i];
    return 0;
}

/* Row keep[k] of a [rows, width] array moved to row k, for k < kept: keep ascends, so each row
   is read before anything is written over it. */
static void keep_rows(float *a, int64_t width, const int64_t *keep, int64_t kept) {
    for (int64_t k = 0; k < kept; k++)
        if (keep[k] != k) memcpy(a + k * width, a + keep[k] * width, (size_t)width * sizeof(float));
}

static int asked_to_yield(const step *s) {
    if (s->yield_flag && __atomic_load_n(s->yield_flag, __ATOMIC_RELAXED)) return 1;
    if (!s->yield_at_ns) return 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000 + now.tv_nsec >= s->yield_at_ns;
}

/* x [tokens, hidden] through layers s->first_layer .. count - 1, in place; with s->keep, x's
   first s->kept rows are then the kept rows' outputs. The last layer's attention, o and MLP run
   only for those rows: the other rows only leave their K and V for later steps (a prefill
   samples from its last row alone). Each row's result is the same either way: these operations
   work row by row, and only x carries anything from one layer to the next, so a step stopped
   between layers and run on later computes the same bits.
   Returns the layers run to (count once done; fewer where asked to yield), or -1 when a matmul
   failed (its instruction set is not supported here, or memory ran out). */
int64_t decoder_layers(const layer *layers, int64_t count, const step *all, float *x) {
    step kept = *all;
    kept.tokens = all->kept, kept.positions = all->kept_positions, kept.table_rows = all->kept_table_rows;
    const step *s = all;
    for (int64_t i = all->first_layer; i < count; i++) {
        if (i > all->first_layer && asked_to_yield(all)) return i;
        const layer *l = layers + i;
        int64_t d = l->head_dim;
        run_rows(OP_INPUT_NORM, l, s, x);
        if (run_linear(&l->qkv, s, s->normed, s->qkv)) return -1;
        run_rows(OP_QK_ROPE_KV, l, s, x);
        if (i == count - 1 && all->keep) {
            keep_rows(s->qk, (l->heads + l->kv_heads) * d, all->keep, all->kept);
            keep_rows(x, s->hidden, all->keep, all->kept);
            s = &kept;
            if (!s->tokens) return count;
        }
        attention_job a = {s->qk, (l->heads + l->kv_heads) * d, s->tokens, l->heads, l->kv_heads, d, l->k_cache,
                           l->v_cache, s->tables, s->table_width, s->table_rows, s->positions, s->block_size,
                           l->window, l->scale, l->softcap, s->attn, l->kv_half};
        run_attention(&a, s->parallel, s->threads);
        if (run_linear(&l->o, s, s->attn, s->h)) return -1;
        run_rows(OP_ATTENTION_RESIDUAL, l, s, x);
        if (run_linear(&l->gate_up, s, s->normed, s->gate_up)) return -1;
        run_rows(OP_GATED, l, s, x);
        if (run_linear(&l->down, s, s->act, s->h)) return -1;
        run_rows(OP_MLP_RESIDUAL, l, s, x);
    }
    return count;
}

/* A greedy step whole: token ids -> the embedding rows in x [tokens, hidden] -> decoder_layers ->
   the final norm and the LM head's argmax of the rows the caller reads (s->kept of them with
   s->keep, else all), into argmax. The same operations as the embedding gather, decoder_layers,
   rms_norm and the head's argmax called one by one from Python (decoder.py), so the same tokens:
   what goes is the Python between them, a few percent of a batch-1 step, its caches cold after
   the head's weights. Returns as decoder_layers does (s->first_layer must be 0): where it
   stopped early, x holds the rows after that many layers, and no token was picked. */
int64_t decoder_greedy(const layer *layers, int64_t count, const ends *e, const step *s, const int64_t *ids,
                       float *x, int64_t *argmax) {
    int64_t hidden = s->hidden, rows = s->keep ? s->kept : s->tokens;
    if (e->embed_rows(e->embed_type, e->embed, e->embed_row_bytes, hidden, ids, s->tokens, e->embed_scale, x, hidden))
        return -1;
    int64_t done = decoder_layers(layers, count, s, x);
    if (done != count || !rows) return done;
    rms_norm(x, hidden, e->final_norm, e->eps, rows, hidden, s->normed);
    return e->argmax(s->normed, hidden, rows, hidden, e->head, e->vocab, argmax, s->isa, s->threads) ? -1 : count;
}
