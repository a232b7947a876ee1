/* A token drawn from each row of a step's logits for requests that sample: temperature, top-k
   and top-p over a 262k-token vocabulary without sorting it, and without the dozen torch ops
   per row (with them, sampling cost as much as a 64-row step's matmuls).

   A row's weights are e^((logit - max) / temperature). top_k keeps the k highest logits (the
   earlier token on ties, as argmax); top_p then keeps the shortest most-likely-first prefix
   whose weight reaches top_p of the weight left after top_k (the top token always stays). The
   kept tokens are found with a heap, not a sort: one pass over the row, in which a block of
   logits is looked at one by one only when one of them beats the current k-th. The draw
   inverts the running weight at u * total in token order, as torch's cumsum and searchsorted
   would. A row's token depends on its own logits and uniform alone, never on the batch. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"

typedef void (*task_fn)(void *ctx, int part, int parts);
typedef void (*parallel_fn)(int threads, task_fn fn, void *ctx);

enum { LANES = 16, BLOCK = 256 };
enum { TOP_P_FIRST = 64 };  /* tokens first looked at for top_p alone: most rows' mass is there */

typedef struct {
    float logit;
    int64_t token;
} candidate;

static inline float weight(float logit, float max, float inv_t) {
    return logit == -INFINITY ? 0.0f : exp_poly((logit - max) * inv_t);
}

typedef float lanes_f __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lanes_i __attribute__((vector_size(LANES * sizeof(float))));

static inline float lanes_sum(float *lanes) {  /* a tree: short dependency chains */
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lanes[l] += lanes[l + w];
    return lanes[0];
}

static float row_max(const float *x, int64_t n) {
    lanes_f m;
    for (int l = 0; l < LANES; l++) m[l] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        lanes_f v;
        memcpy(&v, x + i, sizeof v);
        lanes_i more = v > m;  /* a select in vector form: C has no ?: on vectors */
        m = (lanes_f)((more & (lanes_i)v) | (~more & (lanes_i)m));
    }
    float best = -INFINITY;
    for (int l = 0; l < LANES; l++) best = m[l] > best ? m[l] : best;
    for (; i < n; i++) best = x[i] > best ? x[i] : best;
    return best;
}

/* The weight of x[0, n), n <= BLOCK, summed in a fixed order (LANES running sums). */
static float block_weight(const float *x, int64_t n, float max, float inv_t) {
    float lanes[LANES] = {0};
    if (n == BLOCK) {
        for (int i = 0; i < BLOCK; i += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += weight(x[i + l], max, inv_t);
    } else {
        for (int64_t i = 0; i < n; i++) lanes[i % LANES] += weight(x[i], max, inv_t);
    }
    return lanes_sum(lanes);
}

static double total_weight(const float *x, int64_t vocab, float max, float inv_t) {
    double total = 0.0;
    for (int64_t i = 0; i < vocab; i += BLOCK) total += block_weight(x + i, vocab - i < BLOCK ? vocab - i : BLOCK, max, inv_t);
    return total;
}

/* The whole vocabulary: the first token whose running weight passes u * total. One pass of
   e^x: each block's weight is kept, so the walk to u * total steps over whole blocks and
   computes weights again only inside the block it lands in. -1 when memory ran out. */
static int64_t draw_all(const float *x, int64_t vocab, float max, float inv_t, double u) {
    int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    float *block = malloc(sizeof(float) * blocks);
    if (!block) return -1;
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        block[b] = block_weight(x + b * BLOCK, vocab - b * BLOCK < BLOCK ? vocab - b * BLOCK : BLOCK, max, inv_t);
        total += block[b];
    }
    double cum = 0.0, target = u * total;
    int64_t token = -2;
    for (int64_t b = 0; b < blocks && token == -2; b++) {
        if (cum + block[b] > target) {
            int64_t end = vocab < (b + 1) * BLOCK ? vocab : (b + 1) * BLOCK;
            double within = cum;
            for (int64_t i = b * BLOCK; i < end; i++) {
                within += weight(x[i], max, inv_t);
                if (within > target && x[i] != -INFINITY) {
                    token = i;
                    break;
                }
            }
        }
        cum += block[b];
    }
    free(block);
    if (token >= 0) return token;
    /* only by rounding: the last token that has any weight */
    for (int64_t i = vocab - 1; i > 0; i--)
        if (x[i] != -INFINITY) return i;
    return 0;
}

/* a ranks below b */
static inline int below(candidate a, candidate b) {
    return a.logit < b.logit || (a.logit == b.logit && a.token > b.token);
}

static void sift_down(candidate *heap, int64_t n, int64_t at) {
    for (;;) {
        int64_t low = at, l = 2 * at + 1, r = l + 1;
        if (l < n && below(heap[l], heap[low])) low = l;
        if (r < n && below(heap[r], heap[low])) low = r;
        if (low == at) return;
        candidate t = heap[at];
        heap[at] = heap[low];
        heap[low] = t;
        at = low;
    }
}

static void push(candidate *heap, int64_t n, candidate c) {
    int64_t at = n;
    heap[at] = c;
    while (at > 0 && below(heap[at], heap[(at - 1) / 2])) {
        candidate t = heap[at];
        heap[at] = heap[(at - 1) / 2];
        heap[(at - 1) / 2] = t;
        at = (at - 1) / 2;
    }
}

/* The k highest-ranked tokens of x into heap (the lowest-ranked at the root); how many. Tokens
   come in increasing order, so one that only ties the root's logit ranks below it. */
static int64_t top_tokens(const float *x, int64_t vocab, int64_t k, candidate *heap) {
    int64_t n = 0;
    for (int64_t i0 = 0; i0 < vocab; i0 += LANES) {
        int64_t end = vocab - i0 < LANES ? vocab : i0 + LANES;
        if (n == k) {
            float bar = heap[0].logit;
            int beats = 0;
            for (int64_t i = i0; i < end; i++) beats |= x[i] > bar;
            if (!beats) continue;
        }
        for (int64_t i = i0; i < end; i++) {
            if (n < k) {
                push(heap, n++, (candidate){x[i], i});
            } else if (x[i] > heap[0].logit) {
                heap[0] = (candidate){x[i], i};
                sift_down(heap, n, 0);
            }
        }
    }
    return n;
}

static int by_rank(const void *a, const void *b) {  /* highest first */
    candidate x = *(const candidate *)a, y = *(const candidate *)b;
    return below(y, x) ? -1 : below(x, y) ? 1 : 0;
}

static int by_token(const void *a, const void *b) {
    int64_t x = ((const candidate *)a)->token, y = ((const candidate *)b)->token;
    return (x > y) - (x < y);
}

/* One row; -1 when memory ran out. */
static int64_t draw_row(const float *x, int64_t vocab, float temperature, int64_t top_k, float top_p, double u) {
    float inv_t = 1.0f / temperature, max = row_max(x, vocab);
    if (top_k <= 0 || top_k >= vocab) top_k = 0;
    if (!top_k && top_p >= 1.0f) return draw_all(x, vocab, max, inv_t, u);
    double all = top_k ? 0.0 : total_weight(x, vocab, max, inv_t);
    for (int64_t want = top_k ? top_k : TOP_P_FIRST;;) {
        candidate *kept = malloc(sizeof(candidate) * want);
        if (!kept) return -1;
        int64_t n = top_tokens(x, vocab, want, kept);
        qsort(kept, n, sizeof *kept, by_rank);
        double total = all;
        if (top_k)
            for (int64_t j = 0; j < n; j++) total += weight(kept[j].logit, max, inv_t);
        int64_t count = n;
        if (top_p < 1.0f) {
            double mass = 0.0, limit = top_p * total;
            for (count = 0; count < n && mass < limit; count++) mass += weight(kept[count].logit, max, inv_t);
            if (mass < limit && !top_k && n < vocab) {  /* the prefix runs past what was looked at */
                free(kept);
                want = want * 16 < vocab ? want * 16 : vocab;
                continue;
            }
        }
        qsort(kept, count, sizeof *kept, by_token);
        double sum = 0.0;
        for (int64_t j = 0; j < count; j++) sum += weight(kept[j].logit, max, inv_t);
        double cum = 0.0, target = u * sum;
        int64_t token = kept[0].token;
        for (int64_t j = 0; j < count; j++) {
            float w = weight(kept[j].logit, max, inv_t);
            if (w > 0.0f) token = kept[j].token;  /* past the end only by rounding: the last with weight */
            cum += w;
            if (cum > target && w > 0.0f) break;
        }
        free(kept);
        return token;
    }
}

typedef struct {
    const float *logits;
    int64_t vocab, count;
    const int64_t *rows, *top_k;
    const float *temperature, *top_p;
    const double *u;
    int64_t *out;
} draw_job;

static void draw_part(void *ctx, int part, int parts) {
    const draw_job *j = ctx;
    for (int64_t r = j->count * part / parts; r < j->count * (part + 1) / parts; r++)
        j->out[r] = draw_row(j->logits + j->rows[r] * j->vocab, j->vocab, j->temperature[r], j->top_k[r], j->top_p[r],
                             j->u[r]);
}

/* out[r]: the token drawn from logits row rows[r] ([*, vocab], float32) with temperature[r] > 0,
   top_k[r] (0: all), top_p[r] in (0, 1] and u[r] in [0, 1); -1 where memory ran out. Rows are
   split over the matmuls' thread pool (qmatmul.c's q8_parallel). */
void draw_rows(const float *logits, int64_t vocab, const int64_t *rows, int64_t count, const float *temperature,
               const int64_t *top_k, const float *top_p, const double *u, int64_t *out, parallel_fn parallel,
               int32_t threads) {
    draw_job j = {logits, vocab, count, rows, top_k, temperature, top_p, u, out};
    if (threads > 1 && count > 1)
        parallel(threads < count ? threads : (int)count, draw_part, &j);
    else
        draw_part(&j, 0, 1);
}
