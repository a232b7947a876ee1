/* The integer matmul (qmatmul.h): each call quantizes its activations, then its rows pass through
the weights' tiles on the pool's threads, with the kernel of the weights' format and of the
instruction set asked for. Also the entries for benchmarks: the dot-product peak and the read rate. */
#include "qmatmul_simd.h"


/* One C body, compiled for each instruction set and picked at load: the same IEEE operations,
   so the same bits, from every clone (and from quantize_row_avx512 and quantize_row_avx2 below). */
#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
static void quantize_row(const float *restrict x, int64_t nb, int64_t span, int8_t *restrict q,
                         float *restrict scale, int32_t *restrict offset) {
    for (int64_t b0 = 0; b0 < nb; b0 += span) {
        /* |v| as bits orders like |v|, and an integer max reduction vectorizes where a float one
           (NaN rules) does not. */
        uint32_t top = 0;
        for (int64_t b = b0; b < b0 + span; b++) {
            uint32_t bits[QBLOCK];
            memcpy(bits, x + b * QBLOCK, sizeof bits);
            for (int i = 0; i < QBLOCK; i++) {
                uint32_t a = bits[i] & 0x7fffffff;
                top = a > top ? a : top;
            }
        }
        float amax;
        memcpy(&amax, &top, 4);
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t b = b0; b < b0 + span; b++) {
            const float *src = x + b * QBLOCK;
            int32_t sum = 0;
            for (int i = 0; i < QBLOCK; i++) {
                float v = round_even(src[i] * inv);
                int8_t qi = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
                q[XQ(b, 0) + i] = qi;
                sum += qi;
            }
            scale[XS(b, 0)] = amax / 127.0f;
            offset[XS(b, 0)] = -128 * sum;  /* undoes the +128 of the u8 weights in the VNNI paths */
        }
    }
}

#if defined(__x86_64__)
/* quantize_row for AVX-512, written out: gcc's vectorization of the C body spilled and divided twice
   per block, a visible share of a prefill (K3). The same operations in the same order
   (the product rounded before the shift that rounds it to an integer, no fused multiply-add), so
   the same bits; a NaN becomes 0 here as in the C body's conversion. */
__attribute__((target("avx512f,avx512bw")))
static void quantize_row_avx512(const float *restrict x, int64_t nb, int64_t span, int8_t *restrict q,
                                float *restrict scale, int32_t *restrict offset) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const __m512 shift = _mm512_set1_ps(12582912.0f), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    float amax = 0.0f;
    __m512 inv = _mm512_setzero_ps();
    for (int64_t b = 0, next = 0; b < nb; b++) {
        __m512 v[2] = {_mm512_loadu_ps(x + b * QBLOCK), _mm512_loadu_ps(x + b * QBLOCK + 16)};
        if (b == next) {  /* a span's first block: the span's largest |value| */
            __m512i top = _mm512_setzero_si512();
            for (int64_t i = b * 2; i < (b + span) * 2; i++)
                top = _mm512_max_epu32(top, _mm512_and_si512(_mm512_loadu_si512(x + i * 16), magnitude));
            uint32_t bits = _mm512_reduce_max_epu32(top);
            memcpy(&amax, &bits, 4);
            inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            next += span;
        }
        __m512i sum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512 p = _mm512_mul_ps(v[h], inv);
            __asm__("" : "+v"(p));  /* keeps the product's rounding: no fused multiply-add */
            p = _mm512_sub_ps(_mm512_add_ps(p, shift), shift);
            p = _mm512_min_ps(hi, _mm512_max_ps(lo, p));  /* the second operand on NaN: it stays NaN */
            __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(p));
            _mm_storeu_si128((__m128i *)(q + XQ(b, 0) + h * 16), bytes);
            sum = _mm512_add_epi32(sum, _mm512_cvtepi8_epi32(bytes));
        }
        scale[XS(b, 0)] = amax / 127.0f;
        offset[XS(b, 0)] = -128 * _mm512_reduce_add_epi32(sum);  /* undoes the +128 of the u8 weights in the VNNI paths */
    }
}

/* quantize_row for AVX2, written out for the same reason (K4): the same operations in the same order again. Its packing of int32 to
   bytes saturates where the C body's conversion truncates, so a NaN product (an infinite activation
   times its block's inverse scale, 0), converted to INT_MIN, is set to 0 first as the C body leaves
   it: at -128 it turned that row's NaN outputs into infinities. */
__attribute__((target("avx2")))
static void quantize_row_avx2(const float *restrict x, int64_t nb, int64_t span, int8_t *restrict q,
                              float *restrict scale, int32_t *restrict offset) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff), order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const __m256 shift = _mm256_set1_ps(12582912.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    float amax = 0.0f;
    __m256 inv = _mm256_setzero_ps();
    for (int64_t b = 0, next = 0; b < nb; b++) {
        __m256 v[4];
        for (int h = 0; h < 4; h++) v[h] = _mm256_loadu_ps(x + b * QBLOCK + h * 8);
        if (b == next) {  /* a span's first block: the span's largest |value| */
            __m256i top = _mm256_setzero_si256();
            for (int64_t i = b * 4; i < (b + span) * 4; i++)
                top = _mm256_max_epu32(top, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i * 8)), magnitude));
            __m128i t = _mm_max_epu32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
            t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0x4e));
            t = _mm_max_epu32(t, _mm_shuffle_epi32(t, 0xb1));
            uint32_t bits = (uint32_t)_mm_cvtsi128_si32(t);
            memcpy(&amax, &bits, 4);
            inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            next += span;
        }
        __m256i ints[4], sum = _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) {
            __m256 p = _mm256_mul_ps(v[h], inv);
            p = _mm256_sub_ps(_mm256_add_ps(p, shift), shift);
            p = _mm256_min_ps(hi, _mm256_max_ps(lo, p));  /* the second operand on NaN: it stays NaN */
            ints[h] = _mm256_and_si256(_mm256_cvttps_epi32(p), _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_ORD_Q)));
            sum = _mm256_add_epi32(sum, ints[h]);
        }
        /* per 128-bit lane the packs interleave the four vectors' halves: put each back in order */
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
        _mm256_storeu_si256((__m256i *)(q + XQ(b, 0)), _mm256_permutevar8x32_epi32(bytes, order));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        scale[XS(b, 0)] = amax / 127.0f;
        offset[XS(b, 0)] = -128 * _mm_cvtsi128_si32(s);  /* undoes the +128 of the u8 weights in the VNNI paths */
    }
}
#endif

typedef struct {
    const float *x;
    int64_t ldx, m, k;
    int8_t *xq;
    float *xs;
    int32_t *xo;
    int isa;  /* the SIMD paths quantize with their own quantize_row: the bits tests then compare them all */
    int64_t span;  /* blocks per scale */
} quantize_job;

static void quantize_part(void *ctx, int part, int parts) {
    quantize_job *j = ctx;
    int64_t nb = j->k / QBLOCK;
    for (int64_t r = j->m * part / parts; r < j->m * (part + 1) / parts; r++) {  /* row r % MAX_ROWS of its group */
        int64_t group = r / MAX_ROWS * MAX_ROWS, i = r % MAX_ROWS;
        void (*quantize)(const float *, int64_t, int64_t, int8_t *, float *, int32_t *) = quantize_row;
#if defined(__x86_64__)
        if (j->isa == ISA_AVX512VNNI) quantize = quantize_row_avx512;
        if (j->isa == ISA_AVX2 || j->isa == ISA_AVXVNNI) quantize = quantize_row_avx2;
#endif
        quantize(j->x + r * j->ldx, nb, j->span, j->xq + group * j->k + i * QBLOCK, j->xs + group * nb + i, j->xo + group * nb + i);
    }
}

/* ---- the matmul ---- */

/* The running largest output of each lane (column mod TILE) of `rows` rows, out [rows][TILE]: a
   later column replaces only a strictly larger value, and padding never counts. One call a tile,
   not a row: at 64 rows a call per row cost the LM head a million calls a step. */
static void keep_largest_portable(const float *restrict out, int rows, int64_t cols, int64_t col0,
                                  float *restrict best, int32_t *restrict best_col) {
    for (int r = 0; r < rows; r++, out += TILE, best += TILE, best_col += TILE) {
        for (int c = 0; c < TILE; c++) {
            float v = c < cols ? out[c] : -INFINITY;
            int take = v > best[c];
            best[c] = take ? v : best[c];
            best_col[c] = take ? (int32_t)(col0 + c) : best_col[c];
        }
    }
}

#if defined(__x86_64__)
/* The same with plain loads and stores: gcc made the C body's selects masked moves, which Zen 3 runs
   slowly enough to show in the LM head's time at one row (K10). */
_Static_assert(TILE == 16, "a tile's row is two 8-lane registers");
__attribute__((target("avx2")))
static void keep_largest_avx2(const float *out, int rows, int64_t cols, int64_t col0, float *best, int32_t *best_col) {
    for (int h = 0; h < 2; h++) {
        __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(h * 8));
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int32_t)cols), lane));
        __m256i column = _mm256_add_epi32(lane, _mm256_set1_epi32((int32_t)col0));
        for (int r = 0; r < rows; r++) {
            int64_t at = r * TILE + h * 8;
            __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(out + at), valid);
            __m256 b = _mm256_loadu_ps(best + at);
            __m256 take = _mm256_cmp_ps(v, b, _CMP_GT_OQ);
            _mm256_storeu_ps(best + at, _mm256_blendv_ps(b, v, take));
            __m256i kept = _mm256_loadu_si256((const __m256i *)(best_col + at));
            __m256i taken = _mm256_blendv_epi8(kept, column, _mm256_castps_si256(take));
            _mm256_storeu_si256((__m256i *)(best_col + at), taken);
        }
    }
}
#endif

static keep_fn keep_largest_for(int isa) {
#if defined(__x86_64__)
    if (isa != ISA_PORTABLE) return keep_largest_avx2;
#endif
    (void)isa;
    return keep_largest_portable;
}

void matmul_part(void *ctx, int part, int parts) {
    matmul_job *j = ctx;
    int64_t tiles = (j->n + TILE - 1) / TILE, tb = j->tile_bytes;
    float out[MAX_ROWS * TILE];
    (void)part, (void)parts;
    for (int64_t item; (item = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < j->items;) {
        int64_t range = item % j->ranges, m0 = item / j->ranges * j->row_chunk;
        int64_t m1 = m0 + j->row_chunk < j->m ? m0 + j->row_chunk : j->m;
        int64_t first = tiles * range / j->ranges, last = tiles * (range + 1) / j->ranges;
        int64_t passes = (m1 - m0 + MAX_ROWS - 1) / MAX_ROWS;
        float *best = j->best + range * j->m * TILE;
        int32_t *best_col = j->best_col + range * j->m * TILE;
        for (int64_t r = m0; r < m1 && !j->y && !j->prune; r++)
            for (int c = 0; c < TILE; c++) best[r * TILE + c] = -INFINITY, best_col[r * TILE + c] = (int32_t)(first * TILE + c);
        for (int64_t t = first; t < last; t++) {
            int64_t cols = j->n - t * TILE < TILE ? j->n - t * TILE : TILE;
            const uint8_t *tile = j->packed + t * tb;
            tile_kernel kernel = j->small_kernel && j->largest[t] <= SMALL_VALUES ? j->small_kernel : j->kernel;
            for (int64_t r0 = m0, pass = 0; r0 < m1; r0 += MAX_ROWS, pass++) {
                int rows = (int)(m1 - r0 < MAX_ROWS ? m1 - r0 : MAX_ROWS);
                /* Only a tile's first pass reads it from memory: a lone pass reads PREFETCH bytes
                   ahead, and of several, each fetches its share of the next tile meanwhile. */
                const char *ahead = (const char *)tile + PREFETCH;
                int64_t step = tb / j->nb;
                if (passes > 1) {
                    ahead = (const char *)tile + tb + tb * pass / passes;
                    step = t + 1 < tiles ? (tb + passes * j->nb - 1) / (passes * j->nb) : 0;
                }
                kernel(tile, j->nb, j->xq + r0 * j->k, j->xs + r0 * j->nb, j->xo + r0 * j->nb, rows, out, ahead, step);
                if (j->prune)
                    prune_outputs(j->prune, out, rows, cols, t, r0, range);
                else if (!j->y)
                    j->keep_largest(out, rows, cols, t * TILE, best + r0 * TILE, best_col + r0 * TILE);
                else if (cols == TILE)  /* a copy of constant size, which the compiler inlines */
                    for (int r = 0; r < rows; r++)
                        memcpy(j->y + (r0 + r) * j->ldy + t * TILE, out + r * TILE, TILE * sizeof(float));
                else
                    for (int r = 0; r < rows; r++)
                        memcpy(j->y + (r0 + r) * j->ldy + t * TILE, out + r * TILE, (size_t)cols * sizeof(float));
            }
        }
    }
}

/* The quantized activations and per-range maxima, a buffer kept between calls: one caller at a time. */
static struct { void *data; size_t size; } scratch;
pthread_mutex_t scratch_lock = PTHREAD_MUTEX_INITIALIZER;

/* How many ranges a call of m rows splits its tiles into. */
int64_t ranges_for(const format *f, int64_t m, int64_t k, int64_t tiles, int threads) {
    int64_t ranges = tiles < RANGES_PER_THREAD * threads ? tiles : RANGES_PER_THREAD * threads;
    if (m <= MAX_ROWS) {  /* one pass: the call streams its weights, and each range restarts the stream */
        int64_t by_size = (tiles * f->tile_bytes(k) + MIN_RANGE_BYTES - 1) / MIN_RANGE_BYTES;
        by_size = (by_size + threads - 1) / threads * threads;  /* a whole number per thread */
        ranges = by_size < ranges ? by_size : ranges;
    }
    return ranges;
}

/* The scratch buffer, at least `need` bytes; NULL when memory ran out. The caller holds scratch_lock. */
void *scratch_reserve(size_t need) {
    if (scratch.size < need) {
        void *grown = realloc(scratch.data, need);
        if (!grown) return NULL;
        scratch.data = grown;
        scratch.size = need;
    }
    return scratch.data;
}

/* m rows rounded up to whole groups of MAX_ROWS, as the quantized activations hold them. */
int64_t padded_rows(int64_t m) { return (m + MAX_ROWS - 1) / MAX_ROWS * MAX_ROWS; }


/* Bytes of a call's quantized activations, and room for them in u8 after them where `f` takes that. */
size_t quantized_bytes(const format *f, int64_t m, int64_t k) {
    return (size_t)(padded_rows(m) * (k / QBLOCK * 8 + k + (f->unsigned_activations ? k : 0)));
}

/* The quantized activations at `at`: xs and xo, [padded rows][nb] each, then xq. */
void quantize_rows(const format *f, const float *x, int64_t ldx, int64_t m, int64_t k, void *at, int8_t **xq,
                          float **xs, int32_t **xo, int isa, int threads) {
    int64_t padded = padded_rows(m), nb = k / QBLOCK;
    *xs = at;
    *xo = (int32_t *)(*xs + padded * nb);
    *xq = (int8_t *)(*xo + padded * nb);
    quantize_job q = {x, ldx, m, k, *xq, *xs, *xo, isa, f->superblock_scales ? SUPERBLOCK / QBLOCK : 1};
    if (m * k >= QUANTIZE_PARALLEL)
        run_parallel(threads, quantize_part, &q);
    else
        quantize_part(&q, 0, 1);
}

/* The activations as u8, xq + 128, written after quantize_rows' xq. */
const int8_t *unsigned_activations(const int8_t *xq, int64_t m, int64_t k) {
    uint8_t *xu = (uint8_t *)xq + padded_rows(m) * k;
    for (int64_t i = 0; i < padded_rows(m) * k; i++) xu[i] = (uint8_t)xq[i] ^ 0x80;
    return (const int8_t *)xu;
}

int64_t row_chunk_for(int64_t k) {
    int64_t row_chunk = ROW_CHUNK_BYTES / k;
    return row_chunk < MAX_ROWS ? MAX_ROWS : row_chunk / MAX_ROWS * MAX_ROWS;
}

int run_matmul(const format *f, const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                      int64_t ldy, int64_t *argmax, int isa, int threads) {
    if (isa < 0 || isa >= ISA_COUNT || !q8_isa_supported(isa)) return -1;
    threads = clamped_threads(threads);
    int64_t nb = k / QBLOCK, tiles = (n + TILE - 1) / TILE, ranges = ranges_for(f, m, k, tiles, threads);
    size_t maxima = y ? 0 : (size_t)(ranges * m * TILE * 8);
    pthread_mutex_lock(&scratch_lock);
    float *best = scratch_reserve(maxima + quantized_bytes(f, m, k));  /* 4-byte items first, then bytes */
    if (!best) {
        pthread_mutex_unlock(&scratch_lock);
        return -1;
    }
    int32_t *best_col = (int32_t *)(best + (y ? 0 : ranges * m * TILE));
    int8_t *xq;
    float *xs;
    int32_t *xo;
    quantize_rows(f, x, ldx, m, k, best_col + (y ? 0 : ranges * m * TILE), &xq, &xs, &xo, isa, threads);
    if (f->activation_sums) f->activation_sums(xq, xo, m, k, threads);
    int64_t row_chunk = row_chunk_for(k);
    matmul_job j = {f->kernel_for(isa), f->small_kernel_for(isa), packed + tiles * f->tile_bytes(k), f->tile_bytes(k),
                    f->unsigned_activations ? unsigned_activations(xq, m, k) : xq, xs, xo, m, k, n, nb, row_chunk,
                    ranges,
                    (m + row_chunk - 1) / row_chunk * ranges, 0, packed, y, ldy, best, best_col, keep_largest_for(isa),
                    NULL};
    run_parallel(threads, matmul_part, &j);
    for (int64_t r = 0; r < m && !y; r++) {  /* the largest over ranges and lanes; a tie keeps the first column */
        float top = -INFINITY;
        int32_t col = INT32_MAX;
        for (int64_t i = 0; i < ranges * TILE; i++) {
            float v = best[(i / TILE * m + r) * TILE + i % TILE];
            int32_t c = best_col[(i / TILE * m + r) * TILE + i % TILE];
            if (v > top || (v == top && c < col)) top = v, col = c;
        }
        argmax[r] = col;
    }
    pthread_mutex_unlock(&scratch_lock);
    return 0;
}

/* Each format's entries:
   kind_matmul: y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T, W packed as kind;
   kind_matmul_argmax: argmax[r] = the column of row r's largest output of the same product (the
   first on ties), without writing the outputs: the greedy token of an LM head.
   Each returns 0, or -1 when the instruction set is not supported here or memory ran out. */
#define MATMUL_ENTRIES(kind, FORMAT)                                                                          \
    int kind##_matmul(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n,    \
                      float *y, int64_t ldy, int isa, int threads) {                                          \
        return run_matmul(&FORMAT, x, ldx, m, k, packed, n, y, ldy, NULL, isa, threads);                      \
    }                                                                                                         \
    int kind##_matmul_argmax(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed,        \
                             int64_t n, int64_t *argmax, int isa, int threads) {                              \
        return run_matmul(&FORMAT, x, ldx, m, k, packed, n, NULL, 0, argmax, isa, threads);                   \
    }
MATMUL_ENTRIES(q8, Q8)
MATMUL_ENTRIES(q5, Q5)
MATMUL_ENTRIES(q4k, Q4K)
MATMUL_ENTRIES(q6k, Q6K)
MATMUL_ENTRIES(q5k, Q5K)
MATMUL_ENTRIES(q40, Q40)
/* (each GGUF format's file adds its line here) */

/* A linear whose parts are packed in different formats (a GGUF's q, k and v of two types, fused
   into one matmul): each part writes its own columns of y. */
typedef int (*part_matmul)(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
                           float *y, int64_t ldy, int isa, int threads);
#define MAX_PARTS 4
typedef struct {
    int64_t count;
    struct { part_matmul matmul; const uint8_t *packed; int64_t n; } parts[MAX_PARTS];
} parts_weight;

int parts_matmul(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                 int64_t ldy, int isa, int threads) {
    const parts_weight *w = (const parts_weight *)packed;
    (void)n;
    for (int64_t i = 0, col = 0; i < w->count; col += w->parts[i].n, i++)
        if (w->parts[i].matmul(x, ldx, m, k, w->parts[i].packed, w->parts[i].n, y + col, ldy, isa, threads)) return -1;
    return 0;
}

/* The same for W packed in signed tiles (signed_packed_bytes(n, k) bytes). */
int signed_matmul(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
                  int64_t ldy, int isa, int threads) {
    return run_matmul(&SIGNED, x, ldx, m, k, packed, n, y, ldy, NULL, isa, threads);
}

/* ---- the dot-product peak: registers only, for benchmarks to measure against ---- */

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512vnni")))
static int64_t peak_avx512vnni(int64_t iters) {
    __m512i acc[12], a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(2);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t n = 0; n < iters; n++) {
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));  /* keeps the loop from being folded away */
    }
    int64_t sum = 0;
    for (int i = 0; i < 12; i++) sum += _mm512_reduce_add_epi32(acc[i]);
    return sum;
}

/* Written in assembly: gcc's C for this loop kept its accumulators on the stack, and a store and
   reload per multiply-add measured well under the peak (K11). Six chains
   of vpmaddubsw + vpmaddwd + vpaddd, 32 multiply-adds each, all in registers. */
#define PEAK_AVX2_CHAIN(t, acc)                               \
    "vpmaddubsw %%ymm7, %%ymm6, %%ymm" #t "\n\t"               \
    "vpmaddwd %%ymm8, %%ymm" #t ", %%ymm" #t "\n\t"           \
    "vpaddd %%ymm" #t ", %%ymm" #acc ", %%ymm" #acc "\n\t"
__attribute__((target("avx2")))
static int64_t peak_avx2(int64_t iters) {
    int32_t lanes[8];
    int64_t sum = 0;
    if (iters <= 0) return 0;
    __asm__ volatile(
        "vpcmpeqw %%ymm8, %%ymm8, %%ymm8\n\t"
        "vpsrlw $15, %%ymm8, %%ymm8\n\t"       /* int16 ones */
        "vpsllw $1, %%ymm8, %%ymm7\n\t"        /* bytes 2 and 0 */
        "vpabsb %%ymm8, %%ymm6\n\t"            /* bytes 1 and 0 */
        "vpxor %%ymm0, %%ymm0, %%ymm0\n\t"
        "vmovdqa %%ymm0, %%ymm1\n\t"
        "vmovdqa %%ymm0, %%ymm2\n\t"
        "vmovdqa %%ymm0, %%ymm3\n\t"
        "vmovdqa %%ymm0, %%ymm4\n\t"
        "vmovdqa %%ymm0, %%ymm5\n\t"
        "1:\n\t"
        PEAK_AVX2_CHAIN(9, 0) PEAK_AVX2_CHAIN(10, 1) PEAK_AVX2_CHAIN(11, 2)
        PEAK_AVX2_CHAIN(12, 3) PEAK_AVX2_CHAIN(13, 4) PEAK_AVX2_CHAIN(14, 5)
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        "vpaddd %%ymm1, %%ymm0, %%ymm0\n\t"
        "vpaddd %%ymm3, %%ymm2, %%ymm2\n\t"
        "vpaddd %%ymm5, %%ymm4, %%ymm4\n\t"
        "vpaddd %%ymm2, %%ymm0, %%ymm0\n\t"
        "vpaddd %%ymm4, %%ymm0, %%ymm0\n\t"
        "vmovdqu %%ymm0, %[lanes]\n\t"
        "vzeroupper"
        : [n] "+r"(iters), [lanes] "=m"(lanes)
        :
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "cc");
    for (int j = 0; j < 8; j++) sum += lanes[j];
    return sum;
}
#endif

typedef struct { int isa; int64_t iters; atomic_llong sink; } peak_job;

static void peak_part(void *ctx, int part, int parts) {
    peak_job *j = ctx;
    (void)part, (void)parts;
#if defined(__x86_64__)
    atomic_fetch_add(&j->sink, j->isa == ISA_AVX512VNNI ? peak_avx512vnni(j->iters) : peak_avx2(j->iters));
#endif
}

/* u8 x s8 multiply-adds done per thread by q8_peak: iters x 12 x 64 (AVX512-VNNI) or iters x 6 x 32 (AVX2).
   Runs on every thread of the pool; -1 for an instruction set it has no loop for. */
int64_t q8_peak(int isa, int64_t iters, int threads) {
    if ((isa != ISA_AVX512VNNI && isa != ISA_AVX2) || !q8_isa_supported(isa)) return -1;
    peak_job j = {isa, iters, 0};
    run_parallel(threads, peak_part, &j);
    return isa == ISA_AVX512VNNI ? iters * 12 * 64 : iters * 6 * 32;
}

/* What the machine's cores can read: each thread xors its share of `buf` in wide words. A
   torch sum on the same threads reads well below this (benchmarks/README.md has the figures), so
   the one-row kernels, measured against it, seemed to beat the memory. */
typedef struct { const uint64_t *buf; int64_t words; atomic_ullong sink; } read_job;

static void read_part(void *ctx, int part, int parts) {
    read_job *j = ctx;
    uint64_t acc[8] = {0};
    int64_t lo = j->words * part / parts / 8 * 8, hi = part == parts - 1 ? j->words : j->words * (part + 1) / parts / 8 * 8;
    int64_t i = lo;
    for (; i + 8 <= hi; i += 8)
        for (int w = 0; w < 8; w++) acc[w] ^= j->buf[i + w];
    for (; i < hi; i++) acc[0] ^= j->buf[i];
    atomic_fetch_xor(&j->sink, acc[0] ^ acc[1] ^ acc[2] ^ acc[3] ^ acc[4] ^ acc[5] ^ acc[6] ^ acc[7]);
}

/* Reads `bytes` of `buf` (8-byte aligned, a whole number of words) once, shared among the pool's
   threads; returns the xor of its words, so the reads cannot be elided. */
uint64_t q8_read(const void *buf, int64_t bytes, int threads) {
    read_job j = {buf, bytes / 8, 0};
    run_parallel(threads, read_part, &j);
    return j.sink;
}

