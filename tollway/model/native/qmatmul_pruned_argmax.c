/* The greedy token of a q8 LM head found on a coarse copy of its weights (qmatmul.h).

At many rows the head is bound by its multiply instructions, and on AVX2 a full-range int8 value
costs a vpsignb beside every vpmaddubsw. The coarse copy holds each value q rounded to
q / COARSE_STEP, within +-SMALL_VALUES, with its scale times COARSE_STEP, in signed tiles, which
AVX2 runs with fewer instructions than its small-value kernel. For each column and block
a reach bounds how far a coarse output can lie from the exact one per unit of the activation block's
scale times its sum of |values| (xa): the block's largest |d q - d' q'|, plus the float rounding of
both outputs' sums (at most nb + 1 roundings of 2^-24 of sum |isum_b| d_b xs_b each, with |q| <= 127
and |q'| <= SMALL_VALUES), doubled, then widened for the float sum of the bound itself. So each
column's exact output lies within coarse -+ sum_b reach_b xa_b.

A column whose upper bound falls short of its row's largest lower bound cannot be the row's argmax,
nor tie it. As the tiles go by, each row keeps a floor (the largest lower bound any thread has seen
so far) and a list of the columns whose upper bound reached it at the time; after the pass, the
columns that reach the row's final floor (about a thousand of Gemma 3's 262144 on real text) are
computed exactly, in column order, from a third copy laid out by column, with the float operations
of every tile kernel: the same column as q8_matmul_argmax, on any instruction set. A full list first
drops the columns the floor has since passed, then the lower half of its upper bounds; a row whose
final floor does not pass every dropped bound (or is not finite: a NaN or infinite activation), or
whose list held only equal bounds, runs the exact matmul, all such rows of a call in one. */
#include "qmatmul_simd.h"

#define COARSE_STEP 8
#define CANDIDATES 4096 /* per row and range; a full list drops the columns the floor has since passed */
_Static_assert(127 / COARSE_STEP + 1 <= SMALL_VALUES, "coarse values are small values");

/* A column of the by-column copy: its nb x 32 signed values, then its nb fp16 scales, padded to a
   cache line. */
int64_t q8_column_bytes(int64_t k) { return (k + k / QBLOCK * 2 + 63) / 64 * 64; }

/* Floats of the reach: [tiles][nb][TILE], then [tiles][nb]. */
int64_t q8_reach_floats(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * (k / QBLOCK) * (TILE + 1); }

/* From a q8 packing of [n, k]: coarse (signed tiles, signed_packed_bytes(n, k) bytes), reach ([tiles][nb][TILE]
   floats, then [tiles][nb]: each tile's largest per block) and columns (n x q8_column_bytes(k) bytes).
   Returns -1 when a coarse scale would pass fp16's range. */
int q8_pack_pruning(const uint8_t *packed, int64_t n, int64_t k, uint8_t *coarse, float *reach, uint8_t *columns) {
    int64_t nb = k / QBLOCK, tiles = (n + TILE - 1) / TILE, tb = q8_tile_bytes(k), cb = q8_column_bytes(k);
    double slack = (double)(nb + 2) * 0x1p-23, widen = 1.0 + (double)(nb + 4) * 0x1p-21;
    for (int64_t t = 0; t < tiles; t++) {
        const uint8_t *src = packed + t * tb;
        const uint16_t *scales = (const uint16_t *)(src + nb * BLOCK_BYTES);
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = coarse + t * signed_tile_bytes(k) + b * SIGNED_BLOCK_BYTES;
            int32_t *offsets = (int32_t *)(dst + BLOCK_BYTES);
            uint16_t *coarse_scales = (uint16_t *)(offsets + TILE);
            for (int lane = 0; lane < TILE; lane++) {
                int64_t col = t * TILE + lane;
                double d = half_to_float(scales[b * TILE + lane]);
                uint16_t half = float_to_half((float)(d * COARSE_STEP));
                if ((half & 0x7c00) == 0x7c00) return -1;
                double dc = half_to_float(half), far = 0.0;
                int32_t sum = 0;
                for (int g = 0; g < GROUPS; g++) {
                    for (int i = 0; i < 4; i++) {
                        int64_t at = b * BLOCK_BYTES + g * TILE * 4 + lane * 4 + i;
                        int q = src[at] - 128, qc = (int)round_even((float)q / COARSE_STEP);
                        dst[g * TILE * 4 + lane * 4 + i] = (uint8_t)(int8_t)qc;
                        sum += qc;
                        far = fmax(far, fabs(d * q - dc * qc));
                        if (col < n) columns[col * cb + b * QBLOCK + g * 4 + i] = (uint8_t)q;
                    }
                }
                offsets[lane] = -128 * sum;
                coarse_scales[lane] = half;
                float r = (float)((far + slack * (127.0 * d + SMALL_VALUES * dc)) * widen);
                reach[(t * nb + b) * TILE + lane] = r;
                float *most = reach + tiles * nb * TILE + t * nb + b;
                *most = lane == 0 || r > *most ? r : *most;
                if (col < n) memcpy(columns + col * cb + k + b * 2, &scales[b * TILE + lane], 2);
            }
        }
    }
    return 0;
}

/* How far each coarse output of a tile can lie from its exact one. Sums over blocks in block order,
   each a multiply and an add (the reach is widened for either rounding), so that a column's reach
   never exceeds its row's reach for the whole tile (from each block's largest). */
#if defined(__x86_64__)
__attribute__((target_clones("avx2", "default")))
#endif
static void column_reach(const float *restrict reach, const float *restrict xa, int r, int64_t nb, float e[TILE]) {
    for (int c = 0; c < TILE; c++) e[c] = 0.0f;
    for (int64_t b = 0; b < nb; b++)
        for (int c = 0; c < TILE; c++) e[c] = e[c] + reach[b * TILE + c] * xa[XS(b, r)];
}

/* The rows (bits) of a tile's outputs out[rows][TILE] that may hold a column reaching the row's
   floor: its largest output (padding columns' 0 included: they only let a row through) plus its
   reach for the whole tile. */
typedef unsigned (*passing_fn)(const float *out, int rows, const float *block_most, const float *xa, int64_t nb,
                               const float floor[MAX_ROWS]);

static unsigned passing_rows_portable(const float *out, int rows, const float *block_most, const float *xa,
                                      int64_t nb, const float floor[MAX_ROWS]) {
    float most[MAX_ROWS] = {0};
    unsigned passing = 0;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < MAX_ROWS; r++) most[r] = most[r] + block_most[b] * xa[XS(b, r)];
    for (int r = 0; r < rows; r++) {
        float top = -INFINITY;
        for (int c = 0; c < TILE; c++) top = out[r * TILE + c] > top ? out[r * TILE + c] : top;
        passing |= (unsigned)(top + most[r] >= floor[r]) << r;
    }
    return passing;
}

#if defined(__x86_64__)
_Static_assert(MAX_ROWS == 8 && TILE == 16, "a row group's values fill one 8-float register, a tile's row two");
__attribute__((target("avx2")))
static unsigned passing_rows_avx2(const float *out, int rows, const float *block_most, const float *xa, int64_t nb,
                                  const float floor[MAX_ROWS]) {
    __m256 most = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        most = _mm256_add_ps(most, _mm256_mul_ps(_mm256_broadcast_ss(block_most + b), _mm256_loadu_ps(xa + XS(b, 0))));
    float tops[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) {
        if (r >= rows) {
            tops[r] = -INFINITY;
            continue;
        }
        __m256 m8 = _mm256_max_ps(_mm256_loadu_ps(out + r * TILE), _mm256_loadu_ps(out + r * TILE + 8));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 0x4e));
        tops[r] = _mm_cvtss_f32(_mm_max_ps(m4, _mm_shuffle_ps(m4, m4, 0xb1)));
    }
    __m256 reach = _mm256_add_ps(_mm256_loadu_ps(tops), most);
    return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(reach, _mm256_loadu_ps(floor), _CMP_GE_OQ));
}
#endif

typedef struct {
    int32_t col;
    float hi;  /* its upper bound */
} candidate;

struct pruning {
    const float *reach, *block_most;
    const float *xa;         /* [padded rows][nb] as xs: each block's scale times its sum of |values| */
    int64_t m, nb;
    float *range_floor;      /* [ranges][m] the largest lower bound found in a range */
    _Atomic float *floor;    /* [m] the largest lower bound seen by any thread so far */
    int32_t *counts;         /* [ranges][m]; past CANDIDATES: the list overflowed */
    float *dropped;          /* [ranges][m] the largest upper bound a full list left out */
    candidate *lists;        /* [ranges][m][CANDIDATES] */
    passing_fn passing_rows;
};

/* A list less its columns below `floor`, in order: its new count, and *dropped raised to the largest
   upper bound left out. */
static int32_t compacted(candidate *list, int32_t count, float floor, float *dropped) {
    int32_t kept = 0;
    for (int32_t i = 0; i < count; i++) {
        if (list[i].hi >= floor)
            list[kept++] = list[i];
        else if (list[i].hi > *dropped)
            *dropped = list[i].hi;
    }
    return kept;
}

/* Room in a full list: first the columns the floor has since passed, then, while their row's floor
   stays low, the lower half of the range of upper bounds. Those may still be needed: a row whose
   final floor does not pass the largest of them runs the exact matmul. */
static int32_t made_room(candidate *list, int32_t count, float floor, float *dropped) {
    float unused = -INFINITY, low = INFINITY, high = -INFINITY;
    count = compacted(list, count, floor, &unused);
    for (int32_t i = 0; i < count && count == CANDIDATES; i++) {
        low = list[i].hi < low ? list[i].hi : low;
        high = list[i].hi > high ? list[i].hi : high;
    }
    return count == CANDIDATES ? compacted(list, count, low + (high - low) / 2, dropped) : count;
}

/* A tile's coarse outputs out[rows][TILE] (rows r0..): the columns whose upper bound reaches their
   row's floor are listed, and the floors raised to the largest lower bound. Most rows, once the
   floor has risen, are passed over on one bound for the whole tile. Another thread may lower the
   shared floor by writing over a larger one: each value ever written is some column's lower bound,
   so a lower floor only lists more columns. */
void prune_outputs(struct pruning *p, const float *out, int rows, int64_t cols, int64_t t, int64_t r0,
                          int64_t range) {
    const float *reach = p->reach + t * p->nb * TILE, *xa = p->xa + r0 * p->nb;
    float floors[MAX_ROWS], e[TILE];
    for (int r = 0; r < MAX_ROWS; r++)
        floors[r] = r < rows ? atomic_load_explicit(&p->floor[r0 + r], memory_order_relaxed) : INFINITY;
    for (unsigned passing = p->passing_rows(out, rows, p->block_most + t * p->nb, xa, p->nb, floors); passing;
         passing &= passing - 1) {
        int r = __builtin_ctz(passing);
        const float *o = out + r * TILE;
        int64_t row = r0 + r, at = range * p->m + row;
        float floor = floors[r], lo = -INFINITY;
        column_reach(reach, xa, r, p->nb, e);
        for (int c = 0; c < cols; c++) lo = o[c] - e[c] > lo ? o[c] - e[c] : lo;
        if (lo > p->range_floor[at]) p->range_floor[at] = lo;
        if (lo > floor) atomic_store_explicit(&p->floor[row], floor = lo, memory_order_relaxed);
        candidate *list = p->lists + at * CANDIDATES;
        int32_t count = p->counts[at];
        for (int c = 0; c < cols; c++) {
            float hi = o[c] + e[c];
            if (!(hi >= floor) || hi <= p->dropped[at]) continue;
            if (count == CANDIDATES) count = made_room(list, count, floor, &p->dropped[at]);
            if (count < CANDIDATES)
                list[count++] = (candidate){(int32_t)(t * TILE + c), hi};
            else
                count = CANDIDATES + 1;  /* all alike: the row runs the exact matmul */
        }
        p->counts[at] = count;
    }
}

/* Exact column `col` of row r (of the group at xq, xs): block sums and float operations as every
   q8 tile kernel does them, in their order, so the same bits. */
static float column_portable(const uint8_t *column, int64_t nb, const int8_t *xq, const float *xs, int r) {
    const int8_t *w = (const int8_t *)column;
    const uint8_t *scales = column + nb * QBLOCK;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *x = xq + XQ(b, r);
        int32_t isum = 0;
        for (int i = 0; i < QBLOCK; i++) isum += w[b * QBLOCK + i] * x[i];
        uint16_t half;
        memcpy(&half, scales + b * 2, 2);
        acc = fmaf((float)isum, half_to_float(half) * xs[XS(b, r)], acc);
    }
    return acc;
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma,f16c")))
static float column_avx2(const uint8_t *column, int64_t nb, const int8_t *xq, const float *xs, int r) {
    const uint8_t *scales = column + nb * QBLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(column + b * QBLOCK));
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq + XQ(b, r)));
        __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        uint16_t half;
        memcpy(&half, scales + b * 2, 2);
        __m128 scale = _mm_mul_ss(_mm_cvtph_ps(_mm_cvtsi32_si128(half)), _mm_set_ss(xs[XS(b, r)]));
        acc = _mm_fmadd_ss(_mm_cvtepi32_ps(s4), scale, acc);
    }
    return _mm_cvtss_f32(acc);
}
#endif

typedef struct {
    const struct pruning *p;
    int64_t ranges, k;
    const uint8_t *columns;
    const int8_t *xq;
    const float *xs;
    int64_t *argmax;
    int isa;
    atomic_llong next;  /* the next row to take */
} rescore_job;

/* Each row's argmax over its listed columns that reach its final floor; -1 where the exact matmul
   must decide. */
static void rescore_part(void *ctx, int part, int parts) {
    rescore_job *j = ctx;
    const struct pruning *p = j->p;
    int64_t nb = p->nb, cb = q8_column_bytes(j->k);
    float (*column)(const uint8_t *, int64_t, const int8_t *, const float *, int) = column_portable;
#if defined(__x86_64__)
    if (j->isa != ISA_PORTABLE) column = column_avx2;
#endif
    (void)part, (void)parts;
    for (int64_t r; (r = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed)) < p->m;) {
        int64_t group = r / MAX_ROWS * MAX_ROWS;
        int i = (int)(r % MAX_ROWS);
        float floor = -INFINITY, dropped = -INFINITY;
        int usable = 1;
        for (int64_t range = 0; range < j->ranges; range++) {
            floor = fmaxf(floor, p->range_floor[range * p->m + r]);
            usable &= p->counts[range * p->m + r] <= CANDIDATES;
            dropped = fmaxf(dropped, p->dropped[range * p->m + r]);
        }
        usable &= dropped < floor;  /* false for a NaN floor too: a NaN or infinite activation */
        float top = -INFINITY;
        int64_t best = -1;
        for (int64_t range = 0; range < j->ranges && usable; range++) {
            const candidate *list = p->lists + (range * p->m + r) * CANDIDATES;
            for (int32_t c = 0; c < p->counts[range * p->m + r]; c++) {
                if (!(list[c].hi >= floor)) continue;
                float v = column(j->columns + list[c].col * cb, nb, j->xq + group * j->k, j->xs + group * nb, i);
                if (best < 0 || v > top) top = v, best = list[c].col;
            }
        }
        j->argmax[r] = isfinite(top) ? best : -1;
    }
}

/* The exact argmax of the rows left at -1, in one call: how many, or -1 when memory ran out. */
static int64_t exact_where_unsettled(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed,
                                     int64_t n, int64_t *argmax, int isa, int threads) {
    int64_t unsettled = 0;
    for (int64_t r = 0; r < m; r++) unsettled += argmax[r] < 0;
    if (!unsettled) return 0;
    float *rows = malloc((size_t)(unsettled * k) * sizeof(float));
    int64_t *found = malloc((size_t)unsettled * sizeof(int64_t));
    int failed = !rows || !found;
    for (int64_t r = 0, i = 0; r < m && !failed; r++)
        if (argmax[r] < 0) memcpy(rows + i++ * k, x + r * ldx, (size_t)k * sizeof(float));
    failed = failed || run_matmul(&Q8, rows, k, unsettled, k, packed, n, NULL, 0, found, isa, threads);
    for (int64_t r = 0, i = 0; r < m && !failed; r++)
        if (argmax[r] < 0) argmax[r] = found[i++];
    free(rows);
    free(found);
    return failed ? -1 : unsettled;
}

/* The same as q8_matmul_argmax on `packed`, found on its pruning copies (q8_pack_pruning). Returns
   how many rows the bounds left to the exact matmul, or -1 when the instruction set is not supported
   here or memory ran out. */
int64_t q8_matmul_argmax_pruned(const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed,
                                const uint8_t *coarse, const float *reach, const uint8_t *columns, int64_t n,
                                int64_t *argmax, int isa, int threads) {
    if (isa < 0 || isa >= ISA_COUNT || !q8_isa_supported(isa)) return -1;
    threads = clamped_threads(threads);
    int64_t nb = k / QBLOCK, tiles = (n + TILE - 1) / TILE, ranges = ranges_for(&Q8, m, k, tiles, threads);
    int64_t padded = padded_rows(m);
    size_t lists = (size_t)(ranges * m) * CANDIDATES * sizeof(candidate);
    size_t floats = (size_t)(3 * ranges * m + m + padded * nb) * 4;
    pthread_mutex_lock(&scratch_lock);
    candidate *list_data = scratch_reserve(lists + floats + quantized_bytes(&SIGNED, m, k));
    if (!list_data) {
        pthread_mutex_unlock(&scratch_lock);
        return -1;
    }
    float *range_floor = (float *)(list_data + (size_t)(ranges * m) * CANDIDATES);
    _Atomic float *floor = (_Atomic float *)(range_floor + ranges * m);
    int32_t *counts = (int32_t *)(floor + m);
    float *dropped = (float *)(counts + ranges * m);
    float *xa = dropped + ranges * m;
    int8_t *xq;
    float *xs;
    int32_t *xo;
    quantize_rows(&Q8, x, ldx, m, k, xa + padded * nb, &xq, &xs, &xo, isa, threads);
    const int8_t *xu = unsigned_activations(xq, m, k);
    for (int64_t i = 0; i < ranges * m; i++) range_floor[i] = dropped[i] = -INFINITY, counts[i] = 0;
    for (int64_t r = 0; r < m; r++) atomic_init(&floor[r], -INFINITY);
    for (int64_t r = 0; r < padded; r++) {  /* each block's scale times its sum of |values| (0 past the rows) */
        int64_t group = r / MAX_ROWS * MAX_ROWS;
        int i = (int)(r % MAX_ROWS);
        for (int64_t b = 0; b < nb; b++) {
            int32_t sum = 0;
            for (int v = 0; v < QBLOCK && r < m; v++) sum += abs(xq[group * k + XQ(b, i) + v]);
            xa[group * nb + XS(b, i)] = r < m ? xs[group * nb + XS(b, i)] * (float)sum : 0.0f;
        }
    }
    struct pruning p = {reach, reach + tiles * nb * TILE, xa, m, nb, range_floor, floor, counts, dropped, list_data,
                        passing_rows_portable};
#if defined(__x86_64__)
    if (isa != ISA_PORTABLE) p.passing_rows = passing_rows_avx2;
#endif
    int64_t row_chunk = row_chunk_for(k);
    matmul_job j = {signed_kernel_for(isa), NULL, NULL, signed_tile_bytes(k), xu, xs, xo, m, k, n, nb,
                    row_chunk, ranges,
                    (m + row_chunk - 1) / row_chunk * ranges, 0, coarse, NULL, 0, NULL, NULL, NULL, &p};
    run_parallel(threads, matmul_part, &j);
    rescore_job rescore = {&p, ranges, k, columns, xq, xs, argmax, isa, 0};
    run_parallel(threads, rescore_part, &rescore);
    pthread_mutex_unlock(&scratch_lock);
    return exact_where_unsettled(x, ldx, m, k, packed, n, argmax, isa, threads);
}

