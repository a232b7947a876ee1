/* Integer matmul y[M,N] = x[M,K] @ W[N,K]^T on weights quantized in blocks of 32 along K.

Weights (packed once at load by q8_pack from floats, or by q8_pack_gguf from a GGUF's Q8_0 blocks): int8 plus an fp16 scale per 32 values, stored +128
as u8, in tiles of 16 output rows. A tile holds, for each K block b, 8 groups of 4 K values,
each as 16 rows x 4 bytes (64 bytes: one 512-bit load puts one row in each 32-bit lane), then
the tile's fp16 scales, 16 per block:

    tile t: [nb][8][16][4] u8 weights, then [nb][16] fp16 scales   (nb = K / 32)

so a dot-product instruction multiplies a broadcast 4-byte group of one activation row with 16
output rows at once, and no horizontal sum is ever needed. After the last tile, one byte a tile
holds its largest |int8 value|: the AVX2 kernel takes the tiles whose values lie within
+-SMALL_VALUES (a GGUF Q5_0 or Q4_0 weight's) a faster way. Activations are quantized per row
and block of 32 to int8 with a float scale at each call.

Every output is the same float sum in every path: acc = fma((float)isum_b, wscale_b * xscale_b,
acc) over blocks b in order, where isum_b is the exact integer dot product of block b. So a row's
result never depends on the other rows of the call, on the thread count, or on the instruction
set; each path just gets isum_b its own way. Threads take items of (a chunk of rows, a range of
tiles); every row of a chunk passes through each tile while it is in cache, so the weights stream
from memory once per call (once per chunk of rows for very large M).

q5 (packed by q5_pack_gguf from a GGUF's Q5_0 blocks: 5-bit values q in 0..31 with an fp16 scale d
per block, w = d * (q - 16), in the file's 5.5 bits a weight) keeps q's low 4 bits in 4 chunks of
64 bytes, chunk p holding groups p (low nibbles) and p + 4 (high nibbles) in the 16-rows-x-4-bytes
order above, then its fifth bits, 64 bytes: bit g of byte j is the fifth bit of byte j of group g's
64 bytes (the 16-rows-x-4-bytes order), then the 16 fp16 scales:

    tile t: [nb] x ([4][16][4] u8 nibble pairs, [64] u8 fifth bits, [16] fp16 scales)

A block's isum is dot(q - 16, xq), so every path sums what q8 does (acc = fma((float)isum_b,
wscale_b * xscale_b, acc)): a Q5_0 block that q8 packs exactly gives q8's bits.

The K-quants (Q4_K, Q5_K, Q6_K) have files of their own (qmatmul_q4k.h, qmatmul_q5k.h,
qmatmul_q6k.h): the same tiles, rows and threads, with their superblocks' scales, and activations
with one scale per superblock of 256 (as llama.cpp's Q8_K), so that a superblock sums in integers
and meets floats once, faster than per-block float steps (6 and 5 vector operations per row and
block beside the 8 multiply-adds; K1). So has q40
(qmatmul_q40.h, a GGUF's Q4_0 in its 4.5 bits): q5's layout without the fifth bits.

An LM head's greedy argmax can also run on a coarse copy of its q8 packing, with bounds that settle
all but a few columns, which are then computed exactly (qmatmul_pruned_argmax.h).

K1..K12 in comments (here and in the .h files) name the measurements behind a choice:
benchmarks/README.md, kernel notes.
*/
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define QBLOCK 32
#define SUPERBLOCK 256                  /* the K-quants' values per d */
#define TILE 16                         /* output rows per tile */
#define GROUPS (QBLOCK / 4)             /* 4-byte groups per block */
#define BLOCK_BYTES (TILE * QBLOCK)     /* weight bytes of one tile and block */
#define MAX_ROWS 8                      /* activation rows per kernel pass */
#define SMALL_VALUES 16                 /* a tile's largest |value| for AVX2's small-value kernel */
#define SMALL_VALUES_LOG2 4
#define ROW_CHUNK_BYTES (256 * 1024)    /* quantized activation rows kept in cache together */
#define QUANTIZE_PARALLEL (64 * 1024)  /* activation values from which the threads share quantizing them */
#define PREFETCH 2048                   /* bytes ahead of the weights being read (K2) */
#define RANGES_PER_THREAD 8             /* items per thread and row chunk: balance when a core is busy (K2) */
#define MIN_RANGE_BYTES (512 * 1024)    /* weights a range reads at least, in a call of one pass: fewer, longer
                                           ranges made one-row decode steps faster (K2) */

enum isa { ISA_PORTABLE, ISA_AVX2, ISA_AVXVNNI, ISA_AVX512VNNI, ISA_COUNT };

static int64_t q8_tile_bytes(int64_t k) { return (k / QBLOCK) * (BLOCK_BYTES + TILE * 2); }

/* The tiles, then a byte a tile: its largest |value|. */
int64_t q8_packed_bytes(int64_t n, int64_t k) {
    int64_t tiles = (n + TILE - 1) / TILE;
    return tiles * q8_tile_bytes(k) + tiles;
}

#define Q4_CHUNK (TILE * 4)                        /* bytes of one chunk: 16 rows x 4 nibble pairs */
#define Q4_NIBBLES (TILE * QBLOCK / 2)             /* nibble bytes of one tile and block */
#define Q5_HIGH (TILE * QBLOCK / 8)                          /* fifth-bit bytes of one tile and block */
#define Q5_BLOCK_BYTES (Q4_NIBBLES + Q5_HIGH + TILE * 2)     /* then the fp16 scales */
#define Q5_OFFSET 16                                         /* w = d * (q - 16) */

static int64_t q5_tile_bytes(int64_t k) { return (k / QBLOCK) * Q5_BLOCK_BYTES; }

/* Signed tiles hold values within +-SMALL_VALUES as signed bytes in q8's order, a block being its
   [8][16][4] values, the 16 columns' -128 x their sum of values (int32), then their 16 fp16 scales:

    tile t: [nb] x ([8][16][4] s8 values, [16] int32 offsets, [16] fp16 scales)

Their kernels take the activations as u8, xq + 128 (up to 255), against the signed values: a
vpmaddubsw pair is at most 2 * 255 * 16, and four groups' pairs sum in int16 (8160 * 4 < 32767);
the offset takes the +128 back out, so isum_b is the exact dot(q, xq) and every output the same
float sum as q8's. On AVX2 they run with fewer instructions than q8's small-value kernel (no vpsubb
per weight load, no offset per row): where AVX2 is the best a CPU has, q5's copy for many rows and
the LM head's coarse copy (qmatmul_pruned_argmax.h) take this layout. */
#define SIGNED_BLOCK_BYTES (BLOCK_BYTES + TILE * 4 + TILE * 2)
static int64_t signed_tile_bytes(int64_t k) { return k / QBLOCK * SIGNED_BLOCK_BYTES; }
int64_t signed_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * signed_tile_bytes(k); }

int64_t q5_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q5_tile_bytes(k); }

/* ---- fp16 <-> fp32, portable and exact (the SIMD paths convert scales with F16C) ---- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000 | (man << 13);
    } else if (exp == 0) {  /* zero or subnormal: man * 2^-24 is exact in float */
        float f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_half(float f) {  /* round to nearest even; scales are finite and >= 0 */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, a = x & 0x7fffffff;
    if (a >= 0x477ff000) return (uint16_t)(sign | 0x7c00);  /* rounds past the largest half */
    if (a < 0x38800000) {  /* subnormal half: round a * 2^24 to an integer */
        float v;
        memcpy(&v, &a, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(v * 16777216.0f));
    }
    uint32_t rounded = a + 0xfff + ((a >> 13) & 1);
    return (uint16_t)(sign | ((rounded - 0x38000000) >> 13));
}

/* Round half to even for |v| < 2^22 without a libm call, so the loops vectorize. */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* ---- packing weights ---- */

/* Returns how many of the tile's blocks have a scale past fp16's range (or NaN weights). */
/* A block's fp16 scale: amax / 127, unless the block lies exactly on a coarser grid of GGUF's
   symmetric formats (Q5_0: amax / 16, Q4_0: amax / 8) that 127 steps would round off. Its int8
   values are then the GGUF's own, and a matmul on them is as exact as the file. */
static uint16_t exact_scale(const float *src, float amax) {
    static const float tops[] = {127.0f, 16.0f, 8.0f};
    for (int t = 0; t < (int)(sizeof tops / sizeof tops[0]); t++) {
        uint16_t half = float_to_half(amax / tops[t]);
        float d = half_to_float(half);
        int exact = d > 0.0f;
        for (int i = 0; i < QBLOCK && exact; i++) exact = round_even(src[i] / d) * d == src[i];
        if (exact) return half;
    }
    return float_to_half(amax / 127.0f);
}

static int64_t pack_tile(const float *w, int64_t n, int64_t k, int64_t t, uint8_t *out, uint8_t *largest) {
    int64_t nb = k / QBLOCK, overflows = 0;
    int top = 0;
    uint16_t *scales = (uint16_t *)(out + nb * BLOCK_BYTES);
    for (int64_t b = 0; b < nb; b++) {
        for (int r = 0; r < TILE; r++) {
            int64_t row = t * TILE + r;
            uint8_t q[QBLOCK];
            uint16_t half = 0;
            if (row < n) {
                const float *src = w + row * k + b * QBLOCK;
                float amax = 0.0f;
                for (int i = 0; i < QBLOCK; i++) {
                    float a = fabsf(src[i]);
                    amax = a > amax ? a : amax;
                }
                half = exact_scale(src, amax);
                overflows += (half & 0x7c00) == 0x7c00;
                float d = half_to_float(half), inv = d > 0.0f ? 1.0f / d : 0.0f;
                for (int i = 0; i < QBLOCK; i++) {
                    float v = round_even(src[i] * inv);
                    int value = (int)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
                    q[i] = (uint8_t)(value + 128);
                    top = abs(value) > top ? abs(value) : top;
                }
            } else {
                memset(q, 128, sizeof q);  /* padding rows: zero weights, zero scale */
            }
            scales[b * TILE + r] = half;
            for (int g = 0; g < GROUPS; g++) memcpy(out + b * BLOCK_BYTES + g * TILE * 4 + r * 4, q + g * 4, 4);
        }
    }
    *largest = (uint8_t)top;
    return overflows;
}

/* ---- the thread pool ----
   A call is split into parts that threads claim: the caller claims too, so a part a worker never
   got to (its core busy with another process, or asleep) is run by the caller, which then waits
   only for the parts workers did claim. */

typedef void (*task_fn)(void *ctx, int part, int parts);

#define MAX_THREADS 256
#define SPIN_NS 100000  /* a worker spins this long for the next call, then sleeps */

static struct {
    pthread_mutex_t call;  /* one caller at a time */
    pthread_mutex_t lock;  /* guards sleeping workers */
    pthread_cond_t wake;
    int threads;           /* including the caller; 0 before the first call */
    pid_t pid;             /* threads do not survive fork: a child starts its own */
    pthread_t ids[MAX_THREADS];
    atomic_uint generation;  /* of the call in flight */
    unsigned started;      /* the generation when the workers were started */
    atomic_ullong claims;  /* generation << 32 | parts claimed so far */
    atomic_int parts;
    atomic_int done;       /* parts finished by workers */
    int quit;
    task_fn fn;
    void *ctx;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__)
    _mm_pause();
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next unclaimed part of call `generation`, or -1 when it has none left or is over. */
static int claim(unsigned generation) {
    unsigned long long c = atomic_load_explicit(&pool.claims, memory_order_acquire);
    for (;;) {
        if ((unsigned)(c >> 32) != generation || (int)(c & 0xffffffffu) >= atomic_load(&pool.parts)) return -1;
        if (atomic_compare_exchange_weak_explicit(&pool.claims, &c, c + 1, memory_order_acq_rel, memory_order_acquire))
            return (int)(c & 0xffffffffu);
    }
}

static void *worker(void *arg) {
    (void)arg;
    unsigned seen = pool.started;  /* not the current one: the first call may come before this runs */
    for (;;) {
        int64_t deadline = now_ns() + SPIN_NS;
        unsigned spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            cpu_relax();
            if (++spins % 64 || now_ns() < deadline) continue;
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        seen = atomic_load_explicit(&pool.generation, memory_order_acquire);
        if (pool.quit) return NULL;
        for (int part; (part = claim(seen)) >= 0;) {
            pool.fn(pool.ctx, part, atomic_load(&pool.parts));
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        }
    }
}

static unsigned publish(task_fn fn, void *ctx, int parts) {
    unsigned generation = atomic_load(&pool.generation) + 1;
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.parts, parts);
    atomic_store(&pool.done, 0);
    atomic_store_explicit(&pool.claims, (unsigned long long)generation << 32, memory_order_release);
    pthread_mutex_lock(&pool.lock);
    atomic_store_explicit(&pool.generation, generation, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    return generation;
}

static void resize_pool(int threads) {
    if (pool.threads > 1 && pool.pid == getpid()) {
        pool.quit = 1;
        publish(NULL, NULL, 0);
        for (int i = 1; i < pool.threads; i++) pthread_join(pool.ids[i], NULL);
        pool.quit = 0;
    }
    pool.threads = 1;
    pool.pid = getpid();
    pool.started = atomic_load(&pool.generation);
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&pool.ids[i], NULL, worker, NULL)) break;
        pool.threads = i + 1;
    }
}

/* Runs fn(ctx, part, parts) for part = 0..parts-1, parts = `threads` (fewer if the system
   refused some), on the pool; returns when all are done. */
static void run_parallel(int threads, task_fn fn, void *ctx) {
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    pthread_mutex_lock(&pool.call);
    if (pool.threads != threads || pool.pid != getpid()) resize_pool(threads);
    int parts = pool.threads, mine = 0;
    if (parts == 1) {
        fn(ctx, 0, 1);
    } else {
        unsigned generation = publish(fn, ctx, parts);
        for (int part; (part = claim(generation)) >= 0; mine++) fn(ctx, part, parts);
        unsigned spins = 0;
        while (atomic_load_explicit(&pool.done, memory_order_acquire) < parts - mine)
            if (++spins % 1024) cpu_relax(); else sched_yield();  /* a worker may have lost its core */
    }
    pthread_mutex_unlock(&pool.call);
}

/* run_parallel for other native code (row_ops.c's layer loop): one pool for the whole step. */
void q8_parallel(int threads, task_fn fn, void *ctx) { run_parallel(threads, fn, ctx); }

/* The threads a call asks for, within what the pool runs. */
static int clamped_threads(int threads) { return threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads; }


/* ---- packing, in parallel over tiles ---- */

typedef struct { const float *w; int64_t n, k; uint8_t *out; atomic_llong overflows; } pack_job;

static void pack_part(void *ctx, int part, int parts) {
    pack_job *j = ctx;
    int64_t tiles = (j->n + TILE - 1) / TILE, overflows = 0, tb = q8_tile_bytes(j->k);
    for (int64_t t = tiles * part / parts; t < tiles * (part + 1) / parts; t++)
        overflows += pack_tile(j->w, j->n, j->k, t, j->out + t * tb, j->out + tiles * tb + t);
    atomic_fetch_add(&j->overflows, overflows);
}

/* w: [n, k] float32 rows, k a multiple of 32; out: q8_packed_bytes(n, k) bytes. Returns the
   number of blocks it cannot represent (|w| beyond 127 x fp16's largest, or NaN): 0 to use it. */
int64_t q8_pack(const float *w, int64_t n, int64_t k, uint8_t *out, int threads) {
    pack_job j = {w, n, k, out, 0};
    run_parallel(threads, pack_part, &j);
    return atomic_load(&j.overflows);
}

/* ---- packing a GGUF file's blocks as they are ----
   Each packer takes a tensor's rows as the file holds them, n rows of k / block values' blocks,
   and writes its format's tiles: the same values, only laid out for the kernels. */

static uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

#define Q8_0_BYTES 34  /* fp16 d, 32 int8 values: w = d * q */

/* Q8_0 rows -> tiles t0..t1 of q8 (q8_packed_bytes(n, k) bytes at out). */
static void q8_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t nb = k / QBLOCK, tiles = (n + TILE - 1) / TILE, tb = q8_tile_bytes(k);
    uint8_t *largest = out + tiles * tb;
    memset(out + t0 * tb, 128, (size_t)((t1 - t0) * tb));  /* padding rows: value 0 */
    for (int64_t t = t0; t < t1; t++) {
        uint8_t *tile = out + t * tb;
        uint16_t *scales = (uint16_t *)(tile + nb * BLOCK_BYTES);
        int top = 0;
        for (int r = 0; r < TILE; r++) {
            int64_t row = t * TILE + r;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *src = blocks + (row * nb + b) * Q8_0_BYTES;
                scales[b * TILE + r] = row < n ? read_u16(src) : 0;
                if (row >= n) continue;
                for (int g = 0; g < GROUPS; g++) {  /* + 128, four bytes at a time */
                    uint32_t four;
                    memcpy(&four, src + 2 + g * 4, 4);
                    four ^= 0x80808080u;
                    memcpy(tile + b * BLOCK_BYTES + g * TILE * 4 + r * 4, &four, 4);
                }
                for (int i = 0; i < QBLOCK; i++) {
                    int v = abs((int8_t)src[2 + i]);
                    top = v > top ? v : top;
                }
            }
        }
        largest[t] = (uint8_t)top;
    }
}

#define Q5_0_BYTES 22  /* fp16 d, 32 fifth bits, 16 bytes of nibbles (value j low, j + 16 high): w = d * (q - 16) */

/* Q5_0 rows -> tiles t0..t1 of q5 (q5_packed_bytes(n, k) bytes at out). */
static void q5_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t nb = k / QBLOCK;
    memset(out + t0 * q5_tile_bytes(k), 0, (size_t)((t1 - t0) * q5_tile_bytes(k)));  /* padding rows: zero scales */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *block = out + (t * nb + b) * Q5_BLOCK_BYTES, *high = block + Q4_NIBBLES;
            uint16_t *scales = (uint16_t *)(high + Q5_HIGH);
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const uint8_t *src = blocks + ((t * TILE + r) * nb + b) * Q5_0_BYTES;
                uint32_t fifth;
                memcpy(&fifth, src + 2, 4);
                for (int i = 0; i < QBLOCK / 2; i++)  /* groups 0..3 low, 4..7 high, as the file's nibbles */
                    block[(i / 4) * Q4_CHUNK + r * 4 + i % 4] = src[6 + i];
                for (int i = 0; i < QBLOCK; i++)  /* value i is byte r * 4 + i % 4 of group i / 4 */
                    high[r * 4 + i % 4] |= (uint8_t)(((fifth >> i) & 1) << (i / 4));
                scales[r] = read_u16(src);
            }
        }
    }
}

/* Packs tiles t0..t1 of a tensor of n rows from its GGUF blocks, with `threads` threads; each
   format's file names its own X_pack_tiles, and GGUF_PACKER(X) exports X_pack_gguf. Loading packs
   a large tensor a part at a time, so that the file's pages of each part can be let go. */
typedef void (*tiles_packer)(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1);
typedef struct {
    tiles_packer pack;
    const uint8_t *blocks;
    int64_t n, k, t0, t1;
    uint8_t *out;
} gguf_pack_job;

static void gguf_pack_part(void *ctx, int part, int parts) {
    gguf_pack_job *j = ctx;
    int64_t span = j->t1 - j->t0;
    j->pack(j->blocks, j->n, j->k, j->out, j->t0 + span * part / parts, j->t0 + span * (part + 1) / parts);
}

#define GGUF_PACKER(kind)                                                                                    \
    void kind##_pack_gguf(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1, \
                          int threads) {                                                                     \
        gguf_pack_job j = {kind##_pack_tiles, blocks, n, k, t0, t1, out};                                    \
        run_parallel(clamped_threads(threads), gguf_pack_part, &j);                                          \
    }
GGUF_PACKER(q8)
GGUF_PACKER(q5)

/* ---- activations: per row and block, int8 values, a float scale, and -128 * their sum ----
   Stored in groups of MAX_ROWS rows, block-major within a group, so a kernel finds block b of
   row r at a fixed offset from the group: values at XQ(b, r), scale and offset at XS(b, r). A
   scale spans `span` blocks (1, or a superblock's 8 for the K-quants), each of them holding it. */

#define XQ(b, r) (((b) * MAX_ROWS + (r)) * QBLOCK)
#define XS(b, r) ((b) * MAX_ROWS + (r))

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

/* ---- the kernels: `rows` activation rows through one tile, 16 float outputs per row ----
   Arguments: the tile, nb, a group of quantized rows (values, scales, offsets), the row count
   (1..MAX_ROWS), and out[rows][16]. */

/* The VNNI kernels read ahead: at block b they prefetch [ahead + b * step, + step), the part of the
   weights the caller will want next (see matmul_part), into L1, and the same span FAR_PREFETCH and
   2 * FAR_PREFETCH bytes further on into L2. The L2 streams keep more lines in flight than the L1
   one alone, which helps the few-row steps that are bound by reading the weights (K5). */
#define FAR_PREFETCH 6144
static inline void prefetch_ahead(const char *ahead, int64_t step, int64_t b) {
    for (int64_t at = 0; at < step; at += 64) {
        __builtin_prefetch(ahead + b * step + at);
        __builtin_prefetch(ahead + FAR_PREFETCH + b * step + at, 0, 2);
        __builtin_prefetch(ahead + 2 * FAR_PREFETCH + b * step + at, 0, 1);
    }
}

/* The AVX2 kernels' read-ahead: the same span AVX2_PREFETCH bytes further on, one stream into L1.
   On the AVX2-only Zen 3 EPYC these kernels issue more instructions per weight byte than the VNNI
   ones, and the three streams above cost more than they hid, at every batch size (K6). */
#define AVX2_PREFETCH 8192
static inline void prefetch_ahead_avx2(const char *ahead, int64_t step, int64_t b) {
    for (int64_t at = 0; at < step; at += 64) __builtin_prefetch(ahead + AVX2_PREFETCH + b * step + at, 0, 3);
}

/* Written before each loop over a kernel's rows or groups: gcc then keeps the accumulator arrays
   in registers. Left to itself it kept acc[] in registers but also stored it to the stack every
   block, 8 stores per 64 dot products, which slowed the LM head (K7). */
#define UNROLLED _Pragma("GCC unroll 8")

/* Written after each update of a 256-bit kernel's integer sums: gcc otherwise reassociates a
   block's additions into one tree over all its groups, computes every product first and spills
   them (64 products a block at 4 rows), which the kernels pay for at every row count (K8). */
#define KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))

typedef void (*tile_kernel)(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                            int rows, float *out, const char *ahead, int64_t ahead_step);

static void tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                          int rows, float *out, const char *ahead, int64_t ahead_step) {
    const uint16_t *scales = (const uint16_t *)(tile + nb * BLOCK_BYTES);
    (void)xo, (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = tile + b * BLOCK_BYTES;
            const int8_t *x = xq + XQ(b, r);
            for (int lane = 0; lane < TILE; lane++) {
                int32_t isum = 0;
                for (int i = 0; i < QBLOCK; i++) isum += ((int32_t)w[(i / 4) * TILE * 4 + lane * 4 + i % 4] - 128) * x[i];
                float s = half_to_float(scales[b * TILE + lane]) * xs[XS(b, r)];
                acc[lane] = fmaf((float)isum, s, acc[lane]);
            }
        }
        memcpy(out + r * TILE, acc, sizeof acc);
    }
}

/* xo holds -128 * the block's sum of quantized activations (for q8's +128 weights): q4 wants the sum. */

static void q5_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                             int rows, float *out, const char *ahead, int64_t ahead_step) {
    (void)xo, (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = tile + b * Q5_BLOCK_BYTES, *high = w + Q4_NIBBLES;
            const uint16_t *scales = (const uint16_t *)(high + Q5_HIGH);
            const int8_t *x = xq + XQ(b, r);
            for (int lane = 0; lane < TILE; lane++) {
                int32_t isum = 0;
                for (int i = 0; i < QBLOCK; i++) {
                    int g = i / 4, at = lane * 4 + i % 4;
                    int nibble = (w[(g % 4) * Q4_CHUNK + at] >> (g < 4 ? 0 : 4)) & 15;
                    isum += (nibble + (((high[at] >> g) & 1) << 4) - Q5_OFFSET) * x[i];
                }
                float s = half_to_float(scales[lane]) * xs[XS(b, r)];
                acc[lane] = fmaf((float)isum, s, acc[lane]);
            }
        }
        memcpy(out + r * TILE, acc, sizeof acc);
    }
}

/* The signed tiles' kernels take xq as the activations in u8 (xq + 128), and no xo. */
static void signed_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                                 int rows, float *out, const char *ahead, int64_t ahead_step) {
    const uint8_t *xu = (const uint8_t *)xq;
    (void)xo, (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        for (int lane = 0; lane < TILE; lane++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *w = tile + b * SIGNED_BLOCK_BYTES;
                int32_t isum;
                uint16_t half;
                memcpy(&isum, w + BLOCK_BYTES + lane * 4, 4);
                memcpy(&half, w + BLOCK_BYTES + TILE * 4 + lane * 2, 2);
                for (int i = 0; i < QBLOCK; i++)
                    isum += (int8_t)w[(i / 4) * TILE * 4 + lane * 4 + i % 4] * xu[XQ(b, r) + i];
                acc = fmaf((float)isum, half_to_float(half) * xs[XS(b, r)], acc);
            }
            out[r * TILE + lane] = acc;
        }
    }
}

#if defined(__x86_64__)

static inline int32_t group_of(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 256-bit kernels take a tile as two halves of 8 lanes and the rows 4 at a time, in a body
   inlined per row count (ROWS4_SWITCH) so that its arrays stay in registers. */
#define ROWS4_SWITCH(body, n, ...)                                                           \
    switch (n) {                                                                             \
        case 1: body(__VA_ARGS__, 1); break;                                                 \
        case 2: body(__VA_ARGS__, 2); break;                                                 \
        case 3: body(__VA_ARGS__, 3); break;                                                 \
        default: body(__VA_ARGS__, 4); break;                                                \
    }

/* The kernels that take both halves of a tile at once do so for up to 3 rows, inlined per count. */
#define ROWS3_SWITCH(body, n, ...)       \
    switch (n) {                         \
        case 1: body(__VA_ARGS__, 1); break; \
        case 2: body(__VA_ARGS__, 2); break; \
        default: body(__VA_ARGS__, 3); break; \
    }

/* The end of a block in the kernels that take both halves of a tile at once: each row's integer
   sums into its float outputs, acc = fma((float)isum, d * xs, acc), with the 16 columns' fp16
   scales d at `scales`; and, after the last block, the outputs stored. */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void add_block(__m256 acc[3][2], __m256i isum[3][2],
                                                             const uint16_t *scales, const float *xs, int64_t b, int r0,
                                                             const int n) {
    UNROLLED for (int h = 0; h < 2; h++) {
        __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + h * 8)));
        UNROLLED for (int r = 0; r < n; r++) {
            __m256 s = _mm256_mul_ps(ws, _mm256_set1_ps(xs[XS(b, r0 + r)]));
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), s, acc[r][h]);
        }
    }
}

__attribute__((target("avx2")))
static inline __attribute__((always_inline)) void store_rows(float *out, __m256 acc[3][2], int r0, const int n) {
    UNROLLED for (int r = 0; r < n; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + (r0 + r) * TILE + h * 8, acc[r][h]);
}

/* A block of 4-bit values (q40's and q4k's: chunk g % 4 holds group g in its low nibbles for g < 4,
   its high ones for g >= 4) against rows r0..r0 + n, both halves of the tile at once, summed in
   int16: q is 0..15, the u8 operand of vpmaddubsw, and a lane's 16 products stay within
   16 * 15 * 128 < 32767. Each broadcast activation group feeds two vpmaddubsw. */
__attribute__((target("avx2")))
static inline __attribute__((always_inline)) void nibble_block_avx2(const uint8_t *w, const int8_t *xq, int64_t b,
                                                                    int r0, __m256i sum16[3][2], const int n) {
    const __m256i low = _mm256_set1_epi8(15);
    UNROLLED for (int g = 0; g < GROUPS; g++) {
        __m256i pairs0 = _mm256_loadu_si256((const __m256i *)(w + (g % 4) * Q4_CHUNK));
        __m256i pairs1 = _mm256_loadu_si256((const __m256i *)(w + (g % 4) * Q4_CHUNK + 32));
        __m256i w0 = _mm256_and_si256(g < 4 ? pairs0 : _mm256_srli_epi16(pairs0, 4), low);
        __m256i w1 = _mm256_and_si256(g < 4 ? pairs1 : _mm256_srli_epi16(pairs1, 4), low);
        UNROLLED for (int r = 0; r < n; r++) {
            __m256i x = _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g * 4));
            __m256i p0 = _mm256_maddubs_epi16(w0, x), p1 = _mm256_maddubs_epi16(w1, x);
            sum16[r][0] = g == 0 ? p0 : _mm256_add_epi16(sum16[r][0], p0);
            sum16[r][1] = g == 0 ? p1 : _mm256_add_epi16(sum16[r][1], p1);
            KEEP_IN_REGISTER(sum16[r][0]);
            KEEP_IN_REGISTER(sum16[r][1]);
        }
    }
}

/* AVX2: vpmaddubsw multiplies u8 by s8 into saturating int16 pairs, so it gets |w| and x with
   w's sign: each pair then stays within 2 * 127 * 127 < 32767, and the sums are exact. The weights
   are read back to signed (xor 0x80), so the sums need no offset. Both halves of the tile at once,
   for up to 3 rows, so that each broadcast activation group serves both: from L2 on a Zen 3 core
   52 GMAC/s where the 256-bit template's body, a half at a time for 4 rows, ran 48. */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void avx2_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                             const float *xs, int r0, float *out, const char *ahead,
                                                             int64_t ahead_step, const int n) {
    const uint16_t *scales = (const uint16_t *)(tile + nb * BLOCK_BYTES);
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[3][2];
    UNROLLED for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * BLOCK_BYTES;
        if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
        __m256i isum[3][2];
        UNROLLED for (int g = 0; g < GROUPS; g++) {
            __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + g * 64)), flip);
            __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + g * 64 + 32)), flip);
            __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
            UNROLLED for (int r = 0; r < n; r++) {
                __m256i x = _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g * 4));
                __m256i d0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, w0)), ones);
                __m256i d1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, w1)), ones);
                isum[r][0] = g == 0 ? d0 : _mm256_add_epi32(isum[r][0], d0);
                isum[r][1] = g == 0 ? d1 : _mm256_add_epi32(isum[r][1], d1);
                KEEP_IN_REGISTER(isum[r][0]);
                KEEP_IN_REGISTER(isum[r][1]);
            }
        }
        add_block(acc, isum, scales + b * TILE, xs, b, r0, n);
    }
    store_rows(out, acc, r0, n);
}

__attribute__((target("avx2,fma,f16c")))
static void tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo, int rows,
                      float *out, const char *ahead, int64_t ahead_step) {
    (void)xo;
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(avx2_rows, rows - r0, tile, nb, xq, xs, r0, out, ahead, ahead_step)
}

/* AVX2 on tiles of small values, three layouts in one body (`layout`, a constant per caller):
   - SMALL_Q8: q8's tiles whose |w| <= SMALL_VALUES = 16, without tile_avx2's vpsignb, which takes a
     multiply port as vpmaddubsw and vpmaddwd do. u = w + 16, in 0..32, is the u8 operand, so each
     int16 pair is at most 2 * 32 * 127 and four groups sum in int16 (< 32767); one vpmaddwd
     widens them. isum = sum(u x) - 16 sum(x), and xo / 8 is -16 sum(x): the same exact integer as
     tile_avx2's, so the same bits. 5 multiply instructions per 4 rows and group where tile_avx2
     takes 13 (K9).
   - SMALL_Q5: q5's tiles (also for AVX-VNNI), whose q is u: each group's low 4 bits from its
     nibbles, its fifth bit from the group's bit of the block's fifth-bit bytes, shifted to bit 4.
   - SMALL_SIGNED: signed tiles (for every x86 path: only where AVX2 is the best are weights packed
     so), the signed values against the activations in u8 (xq + 128, passed as xq), so no offset
     per row and no vpsubb per weight load: each column's -128 sum(w) starts its sums (K9).
   Both halves of the tile at once, for up to 3 rows (3 x 2 int16 sums, int32 sums and float
   outputs: all 16 registers), so that each broadcast activation group feeds two vpmaddubsw:
   faster than a half at a time for 4 rows (K9). */
enum small_layout { SMALL_Q8, SMALL_Q5, SMALL_SIGNED };
_Static_assert(SMALL_VALUES == Q5_OFFSET, "q8's small values and q5's take the same offset");
_Static_assert(SMALL_VALUES == 1 << SMALL_VALUES_LOG2, "the offset's sum is xo shifted");
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void avx2_small_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                   const float *xs, const int32_t *xo, int r0,
                                                                   float *out, const char *ahead, int64_t ahead_step,
                                                                   const enum small_layout layout, const int n) {
    const __m256i to_small = _mm256_set1_epi8(128 - SMALL_VALUES), ones = _mm256_set1_epi16(1);
    const __m256i low = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
    const int64_t block_bytes = layout == SMALL_Q5 ? Q5_BLOCK_BYTES
                                : layout == SMALL_SIGNED ? SIGNED_BLOCK_BYTES : BLOCK_BYTES;
    __m256 acc[3][2];
    UNROLLED for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * block_bytes;
        if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
        __m256i isum[3][2];
        /* SMALL_SIGNED: the columns' offsets from the block; else -16 sum(x) = xo / 8, exactly (xo is
           -128 sum(x)): broadcast from memory and shifted, where `xo / 128 * 16` took a signed
           division's six scalar instructions a row and block */
        UNROLLED for (int r = 0; r < n; r++)
            for (int h = 0; h < 2; h++)
                isum[r][h] = layout == SMALL_SIGNED
                                 ? _mm256_loadu_si256((const __m256i *)(w + BLOCK_BYTES + h * 32))
                                 : _mm256_srai_epi32(_mm256_set1_epi32(xo[XS(b, r0 + r)]), 7 - SMALL_VALUES_LOG2);
        UNROLLED for (int g0 = 0; g0 < GROUPS; g0 += 4) {  /* (q5: the low nibbles' groups, then the high ones') */
            __m256i sum16[3][2];
            UNROLLED for (int g = g0; g < g0 + 4; g++) {
                __m256i u[2];
                UNROLLED for (int h = 0; h < 2; h++) {
                    if (layout == SMALL_Q5) {
                        __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + (g % 4) * Q4_CHUNK + h * 32));
                        __m256i high = _mm256_loadu_si256((const __m256i *)(w + Q4_NIBBLES + h * 32));
                        __m256i nibbles = g < 4 ? pairs : _mm256_srli_epi16(pairs, 4);
                        __m256i bit = g < 4 ? _mm256_slli_epi16(high, 4 - g) : _mm256_srli_epi16(high, g - 4);
                        u[h] = _mm256_or_si256(_mm256_and_si256(nibbles, low), _mm256_and_si256(bit, fifth));
                    } else {
                        u[h] = _mm256_loadu_si256((const __m256i *)(w + g * 64 + h * 32));
                        if (layout == SMALL_Q8) u[h] = _mm256_sub_epi8(u[h], to_small);
                    }
                }
                UNROLLED for (int r = 0; r < n; r++) {
                    __m256i x = _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g * 4));
                    __m256i p0 = layout == SMALL_SIGNED ? _mm256_maddubs_epi16(x, u[0]) : _mm256_maddubs_epi16(u[0], x);
                    __m256i p1 = layout == SMALL_SIGNED ? _mm256_maddubs_epi16(x, u[1]) : _mm256_maddubs_epi16(u[1], x);
                    sum16[r][0] = g == g0 ? p0 : _mm256_add_epi16(sum16[r][0], p0);
                    sum16[r][1] = g == g0 ? p1 : _mm256_add_epi16(sum16[r][1], p1);
                    KEEP_IN_REGISTER(sum16[r][0]);
                    KEEP_IN_REGISTER(sum16[r][1]);
                }
            }
            UNROLLED for (int r = 0; r < n; r++)
                for (int h = 0; h < 2; h++)
                    isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(sum16[r][h], ones));
        }
        const uint16_t *scales = layout == SMALL_Q5     ? (const uint16_t *)(w + Q4_NIBBLES + Q5_HIGH)
                                 : layout == SMALL_SIGNED ? (const uint16_t *)(w + BLOCK_BYTES + TILE * 4)
                                                          : (const uint16_t *)(tile + nb * BLOCK_BYTES) + b * TILE;
        add_block(acc, isum, scales, xs, b, r0, n);
    }
    store_rows(out, acc, r0, n);
}

__attribute__((target("avx2,fma,f16c")))
static void tile_avx2_small(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                            int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(avx2_small_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step, SMALL_Q8)
}

__attribute__((target("avx2,fma,f16c")))
static void q5_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                         int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(avx2_small_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step, SMALL_Q5)
}

__attribute__((target("avx2,fma,f16c")))
static void signed_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                             int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(avx2_small_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step, SMALL_SIGNED)
}

/* 256-bit VNNI, as AVX-VNNI (VEX) and as AVX512-VNNI with VL (EVEX): one body, two encodings. */
#define TILE256 tile_avxvnni
#define TILE256_ROWS avxvnni_rows
#define TILE256_TARGET "avx2,fma,f16c,avxvnni"
#define DOT256 _mm256_dpbusd_avx_epi32
#include "qmatmul_tile256.h"
#undef TILE256
#undef TILE256_ROWS
#undef TILE256_TARGET
#undef DOT256
#define TILE256 tile_vnni256_evex
#define TILE256_ROWS vnni256_evex_rows
#define TILE256_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
#define DOT256 _mm256_dpbusd_epi32
#include "qmatmul_tile256.h"

/* A 512-bit kernel's tile function: `body_` inlined per row count (1..MAX_ROWS), so that its
   accumulator arrays stay in registers. */
#define VNNI512_TILE(name, body_)                                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))                                  \
    static void name(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,   \
                     int rows, float *out, const char *ahead, int64_t ahead_step) {                           \
        switch (rows) {                                                                                       \
            case 1: body_(tile, nb, xq, xs, xo, 1, out, ahead, ahead_step); break;                            \
            case 2: body_(tile, nb, xq, xs, xo, 2, out, ahead, ahead_step); break;                            \
            case 3: body_(tile, nb, xq, xs, xo, 3, out, ahead, ahead_step); break;                            \
            case 4: body_(tile, nb, xq, xs, xo, 4, out, ahead, ahead_step); break;                            \
            case 5: body_(tile, nb, xq, xs, xo, 5, out, ahead, ahead_step); break;                            \
            case 6: body_(tile, nb, xq, xs, xo, 6, out, ahead, ahead_step); break;                            \
            case 7: body_(tile, nb, xq, xs, xo, 7, out, ahead, ahead_step); break;                            \
            default: body_(tile, nb, xq, xs, xo, 8, out, ahead, ahead_step); break;                           \
        }                                                                                                     \
    }
_Static_assert(MAX_ROWS == 8, "VNNI512_TILE has a case per row count");

/* AVX512-VNNI: vpdpbusd multiplies u8 weights by s8 activations, 16 output rows per register.
   The activations' 4-byte group is broadcast by the instruction's own memory operand (gcc's
   intrinsic does it in a separate instruction, which competes with vpdpbusd for its ports). */
__attribute__((target("avx512f,avx512vnni")))
static inline __m512i dpbusd_broadcast(__m512i acc, __m512i w, const int8_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)x));
    return acc;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                const float *xs, const int32_t *xo, const int rows,
                                                                float *out, const char *ahead, int64_t ahead_step) {
    const uint16_t *scales = (const uint16_t *)(tile + nb * BLOCK_BYTES);
    __m512 acc[MAX_ROWS];
    UNROLLED for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * BLOCK_BYTES;
        const int8_t *x = xq + XQ(b, 0);
        prefetch_ahead(ahead, ahead_step, b);
        __m512i isum[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) isum[r] = _mm512_set1_epi32(xo[XS(b, r)]);
        UNROLLED for (int g = 0; g < GROUPS; g++) {
            __m512i wg = _mm512_loadu_si512(w + g * 64);
            UNROLLED for (int r = 0; r < rows; r++) isum[r] = dpbusd_broadcast(isum[r], wg, x + r * QBLOCK + g * 4);
        }
        __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + b * TILE)));
        UNROLLED for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xs[XS(b, r)]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
        }
    }
    UNROLLED for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

/* A block of 4-bit values (q40's and q4k's chunks) into the rows' sums: each 64-byte chunk gives
   two groups, its low and its high nibbles. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void nibble_block_vnni512(const uint8_t *w, const int8_t *x, __m512i *isum,
                                                                       const int rows) {
    const __m512i low = _mm512_set1_epi8(15);
    UNROLLED for (int p = 0; p < 4; p++) {
        __m512i pairs = _mm512_loadu_si512(w + p * Q4_CHUNK);
        __m512i lo = _mm512_and_si512(pairs, low), hi = _mm512_and_si512(_mm512_srli_epi16(pairs, 4), low);
        UNROLLED for (int r = 0; r < rows; r++) {
            isum[r] = dpbusd_broadcast(isum[r], lo, x + r * QBLOCK + p * 4);
            isum[r] = dpbusd_broadcast(isum[r], hi, x + r * QBLOCK + (p + 4) * 4);
        }
    }
}

/* A block of 5-bit values (q5's and q5k's: q4's chunks, each group's fifth bit from the plane at
   w + Q4_NIBBLES or-ed in at bit 4) into the rows' sums: each 64-byte chunk gives two groups. */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __attribute__((always_inline)) void q5_block_vnni512(const uint8_t *w, const int8_t *x, __m512i *isum,
                                                                   const int rows) {
    const __m512i low = _mm512_set1_epi8(15), fifth = _mm512_set1_epi8(16);
    const __m512i high = _mm512_loadu_si512(w + Q4_NIBBLES);
    UNROLLED for (int p = 0; p < 4; p++) {
        __m512i pairs = _mm512_loadu_si512(w + p * Q4_CHUNK);
        __m512i lo = _mm512_or_si512(_mm512_and_si512(pairs, low),
                                     _mm512_and_si512(_mm512_slli_epi16(high, 4 - p), fifth));
        __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(pairs, 4), low),
                                     _mm512_and_si512(_mm512_srli_epi16(high, p), fifth));
        UNROLLED for (int r = 0; r < rows; r++) {
            isum[r] = dpbusd_broadcast(isum[r], lo, x + r * QBLOCK + p * 4);
            isum[r] = dpbusd_broadcast(isum[r], hi, x + r * QBLOCK + (p + 4) * 4);
        }
    }
}

/* q5 on AVX512-VNNI. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void q5_vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                   const float *xs, const int32_t *xo, const int rows,
                                                                   float *out, const char *ahead, int64_t ahead_step) {
    __m512 acc[MAX_ROWS];
    UNROLLED for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * Q5_BLOCK_BYTES;
        const int8_t *x = xq + XQ(b, 0);
        prefetch_ahead(ahead, ahead_step, b);
        __m512i isum[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) isum[r] = _mm512_set1_epi32(xo[XS(b, r)] / 128 * Q5_OFFSET);
        q5_block_vnni512(w, x, isum, rows);
        const uint16_t *scales = (const uint16_t *)(w + Q4_NIBBLES + Q5_HIGH);
        __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)scales));
        UNROLLED for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xs[XS(b, r)]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
        }
    }
    UNROLLED for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

VNNI512_TILE(q5_tile_avx512vnni, q5_vnni512_rows)

VNNI512_TILE(tile_avx512vnni, vnni512_rows)

#endif

/* ---- instruction sets ---- */

int q8_isa_supported(int isa) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    int vnni512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    switch (isa) {
        case ISA_PORTABLE: return 1;
        case ISA_AVX2: return avx2;
        case ISA_AVXVNNI: return (avx2 && __builtin_cpu_supports("avxvnni")) || vnni512;
        case ISA_AVX512VNNI: return vnni512;
    }
    return 0;
#else
    return isa == ISA_PORTABLE;
#endif
}

/* A weight format: its tile size, its kernel per instruction set, the kernel for tiles of small
   values (NULL: none), which finds each tile's largest |value| after the last tile, and whether
   its kernels take the activations as u8 (signed tiles). */
typedef struct {
    int64_t (*tile_bytes)(int64_t k);
    tile_kernel (*kernel_for)(int isa);
    tile_kernel (*small_kernel_for)(int isa);
    int unsigned_activations;
    /* NULL, or a pass after quantizing that rewrites xo as the format's kernels take it (q6k) */
    void (*activation_sums)(const int8_t *xq, int32_t *xo, int64_t m, int64_t k, int threads);
    /* 1: the activations take one scale per SUPERBLOCK values, as the K-quants' kernels sum a
       superblock in integers before its one float step; 0: one per block of QBLOCK */
    int superblock_scales;
} format;

static tile_kernel q8_kernel_for(int isa) {
#if defined(__x86_64__)
    switch (isa) {
        case ISA_AVX2: return tile_avx2;
        case ISA_AVXVNNI: return __builtin_cpu_supports("avxvnni") ? tile_avxvnni : tile_vnni256_evex;
        case ISA_AVX512VNNI: return tile_avx512vnni;
    }
#endif
    return tile_portable;
}

static tile_kernel q5_kernel_for(int isa) {
#if defined(__x86_64__)
    switch (isa) {
        case ISA_AVX2: case ISA_AVXVNNI: return q5_tile_avx2;
        case ISA_AVX512VNNI: return q5_tile_avx512vnni;
    }
#endif
    return q5_tile_portable;
}

static tile_kernel q8_small_kernel_for(int isa) {
#if defined(__x86_64__)
    if (isa == ISA_AVX2) return tile_avx2_small;
#endif
    (void)isa;
    return NULL;
}

static tile_kernel no_small_kernel(int isa) {
    (void)isa;
    return NULL;
}

/* Whether `isa` has a faster kernel for small values: where a pruned argmax pays. */
int q8_has_small_kernel(int isa) { return q8_small_kernel_for(isa) != NULL; }

static tile_kernel signed_kernel_for(int isa) {
#if defined(__x86_64__)
    if (isa != ISA_PORTABLE) return signed_tile_avx2;
#endif
    (void)isa;
    return signed_tile_portable;
}

static const format Q8 = {q8_tile_bytes, q8_kernel_for, q8_small_kernel_for, 0},
                    Q5 = {q5_tile_bytes, q5_kernel_for, no_small_kernel, 0},
                    SIGNED = {signed_tile_bytes, signed_kernel_for, no_small_kernel, 1};

/* The GGUF K-quant formats and q40 (Q4_0), a file each: the layout, the packing of the file's blocks,
   the kernels and the format. */
#include "qmatmul_q4k.h"
#include "qmatmul_q5k.h"
#include "qmatmul_q6k.h"
#include "qmatmul_q40.h"
#include "gguf_rows.h"

/* ---- the matmul ---- */

/* A call's work is items of (a chunk of rows, a range of tiles), taken in order by whichever
   thread is free: a thread that shares its core with another process then does less, and no
   output depends on which thread computed it. */
typedef void (*keep_fn)(const float *out, int rows, int64_t cols, int64_t col0, float *best, int32_t *best_col);

typedef struct {
    tile_kernel kernel;
    tile_kernel small_kernel;  /* for the tiles whose largest[t] <= SMALL_VALUES, or NULL */
    const uint8_t *largest;
    int64_t tile_bytes;
    const int8_t *xq;
    const float *xs;
    const int32_t *xo;
    int64_t m, k, n, nb;
    int64_t row_chunk;      /* rows per item: their quantized values stay in cache */
    int64_t ranges;         /* tile ranges per row chunk */
    int64_t items;
    atomic_llong next;      /* the next item to take */
    const uint8_t *packed;
    float *y;               /* the outputs, row stride ldy; or NULL to keep only each row's largest: */
    int64_t ldy;
    float *best;            /* [ranges][m][TILE] the largest output of each lane's columns in a range */
    int32_t *best_col;      /* [ranges][m][TILE] its column, the first one on ties */
    keep_fn keep_largest;   /* (keep_largest_for) */
    struct pruning *prune;  /* or, for a pruned argmax, the bounds each tile's outputs go to */
} matmul_job;

struct pruning;
static void prune_outputs(struct pruning *p, const float *out, int rows, int64_t cols, int64_t t, int64_t r0,
                          int64_t range);

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

static void matmul_part(void *ctx, int part, int parts) {
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
static pthread_mutex_t scratch_lock = PTHREAD_MUTEX_INITIALIZER;

/* How many ranges a call of m rows splits its tiles into. */
static int64_t ranges_for(const format *f, int64_t m, int64_t k, int64_t tiles, int threads) {
    int64_t ranges = tiles < RANGES_PER_THREAD * threads ? tiles : RANGES_PER_THREAD * threads;
    if (m <= MAX_ROWS) {  /* one pass: the call streams its weights, and each range restarts the stream */
        int64_t by_size = (tiles * f->tile_bytes(k) + MIN_RANGE_BYTES - 1) / MIN_RANGE_BYTES;
        by_size = (by_size + threads - 1) / threads * threads;  /* a whole number per thread */
        ranges = by_size < ranges ? by_size : ranges;
    }
    return ranges;
}

/* The scratch buffer, at least `need` bytes; NULL when memory ran out. The caller holds scratch_lock. */
static void *scratch_reserve(size_t need) {
    if (scratch.size < need) {
        void *grown = realloc(scratch.data, need);
        if (!grown) return NULL;
        scratch.data = grown;
        scratch.size = need;
    }
    return scratch.data;
}

/* m rows rounded up to whole groups of MAX_ROWS, as the quantized activations hold them. */
static int64_t padded_rows(int64_t m) { return (m + MAX_ROWS - 1) / MAX_ROWS * MAX_ROWS; }


/* Bytes of a call's quantized activations, and room for them in u8 after them where `f` takes that. */
static size_t quantized_bytes(const format *f, int64_t m, int64_t k) {
    return (size_t)(padded_rows(m) * (k / QBLOCK * 8 + k + (f->unsigned_activations ? k : 0)));
}

/* The quantized activations at `at`: xs and xo, [padded rows][nb] each, then xq. */
static void quantize_rows(const format *f, const float *x, int64_t ldx, int64_t m, int64_t k, void *at, int8_t **xq,
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
static const int8_t *unsigned_activations(const int8_t *xq, int64_t m, int64_t k) {
    uint8_t *xu = (uint8_t *)xq + padded_rows(m) * k;
    for (int64_t i = 0; i < padded_rows(m) * k; i++) xu[i] = (uint8_t)xq[i] ^ 0x80;
    return (const int8_t *)xu;
}

static int64_t row_chunk_for(int64_t k) {
    int64_t row_chunk = ROW_CHUNK_BYTES / k;
    return row_chunk < MAX_ROWS ? MAX_ROWS : row_chunk / MAX_ROWS * MAX_ROWS;
}

static int run_matmul(const format *f, const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n, float *y,
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

#include "qmatmul_pruned_argmax.h"

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
