/* q8, q5 and the signed tiles (qmatmul.h): packed from float rows, or from a GGUF's Q8_0 and Q5_0
blocks as they are; and the GGUF packers' parallel plumbing, which every format's file uses. */
#include "qmatmul.h"

/* The tiles, then a byte a tile: its largest |value|. */
int64_t q8_packed_bytes(int64_t n, int64_t k) {
    int64_t tiles = (n + TILE - 1) / TILE;
    return tiles * q8_tile_bytes(k) + tiles;
}
int64_t signed_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * signed_tile_bytes(k); }
int64_t q5_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q5_tile_bytes(k); }

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


void pack_gguf_tiles(tiles_packer pack, const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0,
                     int64_t t1, int threads) {
    gguf_pack_job j = {pack, blocks, n, k, t0, t1, out};
    run_parallel(clamped_threads(threads), gguf_pack_part, &j);
}

GGUF_PACKER(q8)
GGUF_PACKER(q5)
