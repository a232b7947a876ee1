/* q40: a GGUF's Q4_0 weights in their own 4.5 bits, laid out for the matmul's tiles of 16
output rows and blocks of 32 along K (qmatmul.h), with its kernels.

Q4_0 keeps blocks of 32 values: an fp16 d and 16 bytes of nibbles (value j the low nibble of byte j,
value j + 16 its high nibble), w = d * (q - 8). Here a tile keeps q5's layout without its fifth bits:
per block the nibbles in 4 chunks of 64 bytes, chunk p holding groups p (low nibbles) and p + 4
(high nibbles) in the 16-rows-x-4-bytes order, then the 16 rows' fp16 scales:

    tile t: [nb] x ([4][16][4] u8 nibble pairs, [16] fp16 scales)

4.5 bits a weight, the file's own. A block's isum is dot(q - 8, xq), exact in integers, and every
path sums acc = fma((float)isum, d * xscale, acc), as q8 and q5 do. The -8 takes the block's sum of
quantized activations: -8 sum(x) = xo / 16, exactly (xo is -128 sum(x)). */
#include "qmatmul_simd.h"

#define Q40_BLOCK_BYTES (Q4_NIBBLES + TILE * 2)  /* nibbles, then the fp16 scales */
#define Q40_OFFSET 8                             /* w = d * (q - 8) */
#define Q4_0_BYTES 18                            /* the file's block: fp16 d, 16 bytes of nibbles */

static int64_t q40_tile_bytes(int64_t k) { return (k / QBLOCK) * Q40_BLOCK_BYTES; }

int64_t q40_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q40_tile_bytes(k); }

/* Q4_0 rows -> tiles t0..t1 of q40 (q40_packed_bytes(n, k) bytes at out). */
static void q40_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t nb = k / QBLOCK;
    memset(out + t0 * q40_tile_bytes(k), 0, (size_t)((t1 - t0) * q40_tile_bytes(k)));  /* padding rows: zero scales */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *block = out + (t * nb + b) * Q40_BLOCK_BYTES;
            uint16_t *scales = (uint16_t *)(block + Q4_NIBBLES);
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const uint8_t *src = blocks + ((t * TILE + r) * nb + b) * Q4_0_BYTES;
                for (int i = 0; i < QBLOCK / 2; i++)  /* groups 0..3 low, 4..7 high, as the file's nibbles */
                    block[(i / 4) * Q4_CHUNK + r * 4 + i % 4] = src[2 + i];
                scales[r] = read_u16(src);
            }
        }
    }
}
GGUF_PACKER(q40)

static void q40_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                              int rows, float *out, const char *ahead, int64_t ahead_step) {
    (void)xo, (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = tile + b * Q40_BLOCK_BYTES;
            const uint16_t *scales = (const uint16_t *)(w + Q4_NIBBLES);
            const int8_t *x = xq + XQ(b, r);
            for (int lane = 0; lane < TILE; lane++) {
                int32_t isum = 0;
                for (int i = 0; i < QBLOCK / 2; i++) {
                    uint8_t pair = w[(i / 4) * Q4_CHUNK + lane * 4 + i % 4];
                    isum += ((pair & 15) - Q40_OFFSET) * x[i] + ((pair >> 4) - Q40_OFFSET) * x[i + QBLOCK / 2];
                }
                float s = half_to_float(scales[lane]) * xs[XS(b, r)];
                acc[lane] = fmaf((float)isum, s, acc[lane]);
            }
        }
        memcpy(out + r * TILE, acc, sizeof acc);
    }
}

#if defined(__x86_64__)

/* q40 on AVX2, also run for AVX-VNNI (same bits: the integer sums are exact either way). q is
0..15, the u8 operand of vpmaddubsw: a block's 16 products per int16 lane stay within 16 * 15 * 128
< 32767, so the block sums in int16 and one vpmaddwd widens it (q4k's way); -8 sum(x) = xo / 16
starts the int32 sum. Both halves of the tile at once, for up to 3 rows. */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void q40_avx2_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                 const float *xs, const int32_t *xo, int r0, float *out,
                                                                 const char *ahead, int64_t ahead_step, const int n) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[3][2];
    UNROLLED for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * Q40_BLOCK_BYTES;
        if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
        __m256i sum16[3][2];
        nibble_block_avx2(w, xq, b, r0, sum16, n);
        __m256i isum[3][2];
        UNROLLED for (int r = 0; r < n; r++) {
            __m256i offset = _mm256_srai_epi32(_mm256_set1_epi32(xo[XS(b, r0 + r)]), 4);  /* -8 sum(x) */
            for (int h = 0; h < 2; h++) isum[r][h] = _mm256_add_epi32(offset, _mm256_madd_epi16(sum16[r][h], ones));
        }
        add_block(acc, isum, (const uint16_t *)(w + Q4_NIBBLES), xs, b, r0, n);
    }
    store_rows(out, acc, r0, n);
}

__attribute__((target("avx2,fma,f16c")))
static void q40_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                          int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(q40_avx2_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step)
}

/* q40 on AVX512-VNNI: -8 sum(x) starts the sums. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void q40_vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                    const float *xs, const int32_t *xo, const int rows,
                                                                    float *out, const char *ahead, int64_t ahead_step) {
    __m512 acc[MAX_ROWS];
    UNROLLED for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * Q40_BLOCK_BYTES;
        const int8_t *x = xq + XQ(b, 0);
        prefetch_ahead(ahead, ahead_step, b);
        __m512i isum[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) isum[r] = _mm512_set1_epi32(xo[XS(b, r)] / 128 * Q40_OFFSET);
        nibble_block_vnni512(w, x, isum, rows);
        __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + Q4_NIBBLES)));
        UNROLLED for (int r = 0; r < rows; r++) {
            __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xs[XS(b, r)]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
        }
    }
    UNROLLED for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

VNNI512_TILE(q40_tile_avx512vnni, q40_vnni512_rows)

#endif

static tile_kernel q40_kernel_for(int isa) {
#if defined(__x86_64__)
    switch (isa) {
        case ISA_AVX2: case ISA_AVXVNNI: return q40_tile_avx2;
        case ISA_AVX512VNNI: return q40_tile_avx512vnni;
    }
#endif
    return q40_tile_portable;
}

const format Q40 = {q40_tile_bytes, q40_kernel_for, no_small_kernel, 0};
