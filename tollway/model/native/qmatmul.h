/* qmatmul.h: what the integer matmul's sources share. The library is one build of them all
(native/qmatmul.py): qmatmul_pool.c (the thread pool), qmatmul_pack.c (q8, q5 and the signed tiles,
packed from floats or from a GGUF's Q8_0 and Q5_0 blocks), qmatmul_kernels.c (their kernels, per
instruction set), a file per GGUF K-quant and Q4_0 with its packing and kernels (qmatmul_q4k.c,
qmatmul_q5k.c, qmatmul_q6k.c, qmatmul_q40.c), qmatmul.c (the activations and the matmul),
qmatmul_pruned_argmax.c and qmatmul_gguf_rows.c; qmatmul_simd.h has the SIMD pieces the kernel
files inline.

Integer matmul y[M,N] = x[M,K] @ W[N,K]^T on weights quantized in blocks of 32 along K.

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

The K-quants (Q4_K, Q5_K, Q6_K) have files of their own (qmatmul_q4k.c, qmatmul_q5k.c,
qmatmul_q6k.c): the same tiles, rows and threads, with their superblocks' scales, and activations
with one scale per superblock of 256 (as llama.cpp's Q8_K), so that a superblock sums in integers
and meets floats once, faster than per-block float steps (6 and 5 vector operations per row and
block beside the 8 multiply-adds; K1). So has q40
(qmatmul_q40.c, a GGUF's Q4_0 in its 4.5 bits): q5's layout without the fifth bits.

An LM head's greedy argmax can also run on a coarse copy of its q8 packing, with bounds that settle
all but a few columns, which are then computed exactly (qmatmul_pruned_argmax.c).

K1..K12 in comments (here and in every qmatmul source) name the measurements behind a choice:
benchmarks/README.md, kernel notes.
*/
#ifndef TOLLWAY_QMATMUL_H
#define TOLLWAY_QMATMUL_H

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


static inline int64_t q8_tile_bytes(int64_t k) { return (k / QBLOCK) * (BLOCK_BYTES + TILE * 2); }


#define Q4_CHUNK (TILE * 4)                        /* bytes of one chunk: 16 rows x 4 nibble pairs */
#define Q4_NIBBLES (TILE * QBLOCK / 2)             /* nibble bytes of one tile and block */
#define Q5_HIGH (TILE * QBLOCK / 8)                          /* fifth-bit bytes of one tile and block */
#define Q5_BLOCK_BYTES (Q4_NIBBLES + Q5_HIGH + TILE * 2)     /* then the fp16 scales */
#define Q5_OFFSET 16                                         /* w = d * (q - 16) */

static inline int64_t q5_tile_bytes(int64_t k) { return (k / QBLOCK) * Q5_BLOCK_BYTES; }

/* Signed tiles hold values within +-SMALL_VALUES as signed bytes in q8's order, a block being its
   [8][16][4] values, the 16 columns' -128 x their sum of values (int32), then their 16 fp16 scales:

    tile t: [nb] x ([8][16][4] s8 values, [16] int32 offsets, [16] fp16 scales)

Their kernels take the activations as u8, xq + 128 (up to 255), against the signed values: a
vpmaddubsw pair is at most 2 * 255 * 16, and four groups' pairs sum in int16 (8160 * 4 < 32767);
the offset takes the +128 back out, so isum_b is the exact dot(q, xq) and every output the same
float sum as q8's. On AVX2 they run with fewer instructions than q8's small-value kernel (no vpsubb
per weight load, no offset per row): where AVX2 is the best a CPU has, q5's copy for many rows and
the LM head's coarse copy (qmatmul_pruned_argmax.c) take this layout. */
#define SIGNED_BLOCK_BYTES (BLOCK_BYTES + TILE * 4 + TILE * 2)
static inline int64_t signed_tile_bytes(int64_t k) { return k / QBLOCK * SIGNED_BLOCK_BYTES; }

/* ---- fp16 <-> fp32, portable and exact (the SIMD paths convert scales with F16C) ---- */

static inline float half_to_float(uint16_t h) {
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

static inline uint16_t float_to_half(float f) {  /* round to nearest even; scales are finite and >= 0 */
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

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* ---- activations: per row and block, int8 values, a float scale, and -128 * their sum ----
   Stored in groups of MAX_ROWS rows, block-major within a group, so a kernel finds block b of
   row r at a fixed offset from the group: values at XQ(b, r), scale and offset at XS(b, r). A
   scale spans `span` blocks (1, or a superblock's 8 for the K-quants), each of them holding it. */

#define XQ(b, r) (((b) * MAX_ROWS + (r)) * QBLOCK)
#define XS(b, r) ((b) * MAX_ROWS + (r))

typedef void (*tile_kernel)(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                            int rows, float *out, const char *ahead, int64_t ahead_step);

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

int q8_isa_supported(int isa);  /* an entry of the library, which the matmul checks too */

/* What the sources call of one another; hidden: the library's own entries are the ones its
functions define without a declaration here (q8_matmul, q4k_pack_gguf, ...). */
#pragma GCC visibility push(hidden)

/* ---- the thread pool (qmatmul_pool.c) ---- */
typedef void (*task_fn)(void *ctx, int part, int parts);
/* Runs fn(ctx, part, parts) for part = 0..parts-1, parts = `threads` (fewer if the system
   refused some), on the pool; returns when all are done. */
void run_parallel(int threads, task_fn fn, void *ctx);
int clamped_threads(int threads);  /* the threads a call asks for, within what the pool runs */

/* ---- packing a GGUF tensor's blocks (qmatmul_pack.c) ----
   Packs tiles t0..t1 of a tensor of n rows from its GGUF blocks, with `threads` threads; each
   format's file names its own X_pack_tiles, and GGUF_PACKER(X) exports X_pack_gguf. Loading packs
   a large tensor a part at a time, so that the file's pages of each part can be let go. */
typedef void (*tiles_packer)(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1);
void pack_gguf_tiles(tiles_packer pack, const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0,
                     int64_t t1, int threads);
#define GGUF_PACKER(kind)                                                                                    \
    void kind##_pack_gguf(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1, \
                          int threads) {                                                                     \
        pack_gguf_tiles(kind##_pack_tiles, blocks, n, k, out, t0, t1, threads);                             \
    }

/* ---- the formats (qmatmul_kernels.c and each format's file) ---- */
extern const format Q8, Q5, SIGNED, Q4K, Q5K, Q6K, Q40;
tile_kernel no_small_kernel(int isa);
tile_kernel signed_kernel_for(int isa);
/* Q4_K's and Q5_K's activation_sums: each block pair's activation sums as two int16 (qmatmul_q4k.c). */
void kmin_pair_sums(const int8_t *xq, int32_t *xo, int64_t m, int64_t k, int threads);

/* ---- the matmul (qmatmul.c), for the pruned argmax beside it ---- */
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
/* A tile's outputs into the pruned argmax's bounds (qmatmul_pruned_argmax.c). */
void prune_outputs(struct pruning *p, const float *out, int rows, int64_t cols, int64_t t, int64_t r0, int64_t range);
void matmul_part(void *ctx, int part, int parts);
/* The call's scratch buffer: quantized activations and per-range maxima, kept between calls. */
extern pthread_mutex_t scratch_lock;
void *scratch_reserve(size_t need);
int64_t ranges_for(const format *f, int64_t m, int64_t k, int64_t tiles, int threads);
int64_t padded_rows(int64_t m);
size_t quantized_bytes(const format *f, int64_t m, int64_t k);
void quantize_rows(const format *f, const float *x, int64_t ldx, int64_t m, int64_t k, void *at, int8_t **xq,
                   float **xs, int32_t **xo, int isa, int threads);
const int8_t *unsigned_activations(const int8_t *xq, int64_t m, int64_t k);
int64_t row_chunk_for(int64_t k);
int run_matmul(const format *f, const float *x, int64_t ldx, int64_t m, int64_t k, const uint8_t *packed, int64_t n,
               float *y, int64_t ldy, int64_t *argmax, int isa, int threads);

#pragma GCC visibility pop
#endif
