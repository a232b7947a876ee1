/* q5k: a GGUF's Q5_K weights in 5.625 bits, laid out for the matmul's tiles of 16 output rows and
blocks of 32 along K (qmatmul.h), with its kernels; it shares Q4_K's superblock head, sums and float
step (qmatmul_kmin.h).

Q5_K keeps superblocks of 256 values: an fp16 d and dmin, 12 bytes of 6-bit scales sc and mins m per
block of 32 (packed as Q4_K's), 32 bytes of fifth bits (bit j of byte i: value i of block j), and 128
bytes of low nibbles (as Q4_K's): w = d * sc * q - dmin * m with q in 0..31. Here a tile keeps q4k's
layout with q5's fifth-bit plane in each block: per superblock q4k's head (its 16 rows' d and dmin,
the m pairs), then per block the nibbles as q5 keeps them (4 chunks of 64 bytes, chunk p holding
groups p and p + 4 as low and high nibbles, 16 rows x 4 bytes), the fifth bits (64 bytes: bit g of
byte j is the fifth bit of byte j of group g's 64 bytes, the 16-rows-x-4-bytes order), then the 16
rows' sc as bytes:

    tile t: [K / 256] x ([16] fp16 d, [16] fp16 dmin, [4][16][2] u8 m, [8] x ([4][16][4] u8 nibble pairs,
                                                                          [64] u8 fifth bits, [16] u8 sc))

5.625 bits a weight against the file's 5.5 (its 12 bytes of packed 6-bit scales become 16 bytes).
Every path sums a superblock as q4k's do, in integers (|S| < 2^26), then one float step. */
#include "qmatmul_kmin.h"

#define Q5K_SUPER 256                                   /* values per superblock */
#define Q5K_BLOCKS (Q5K_SUPER / QBLOCK)                 /* blocks per superblock */
#define Q5K_BLOCK_BYTES (Q4_NIBBLES + Q5_HIGH + TILE)   /* nibbles, fifth bits, then sc */
#define Q5K_SUPER_BYTES (KMIN_HEAD + Q5K_BLOCKS * Q5K_BLOCK_BYTES)
#define Q5_K_BYTES 176  /* the file's superblock: d, dmin, 12 bytes of scales, 32 of fifth bits, 128 of nibbles */

static int64_t q5k_tile_bytes(int64_t k) { return k / Q5K_SUPER * Q5K_SUPER_BYTES; }

int64_t q5k_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q5k_tile_bytes(k); }

/* Q5_K rows (n rows of k / 256 superblocks) -> tiles t0..t1 of q5k (q5k_packed_bytes(n, k) bytes at out). */
static void q5k_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t supers = k / Q5K_SUPER;
    memset(out + t0 * q5k_tile_bytes(k), 0, (size_t)((t1 - t0) * q5k_tile_bytes(k)));  /* padding rows: zero scales and mins */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *super = out + t * q5k_tile_bytes(k) + s * Q5K_SUPER_BYTES;
            uint16_t *d = (uint16_t *)super, *dmin = d + TILE;
            uint8_t *mins = super + TILE * 4;
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const uint8_t *src = blocks + ((t * TILE + r) * supers + s) * Q5_K_BYTES;
                const uint8_t *scales = src + 4, *qh = src + 16, *qs = src + 48;
                d[r] = read_u16(src);
                dmin[r] = read_u16(src + 2);
                for (int j = 0; j < Q5K_BLOCKS; j++) {
                    uint8_t *block = super + KMIN_HEAD + j * Q5K_BLOCK_BYTES, *high = block + Q4_NIBBLES;
                    /* block j is the low (j even) or high nibbles of the file's 32 bytes j / 2, its
                       fifth bits bit j of the 32 bytes qh */
                    const uint8_t *nibbles = qs + j / 2 * 32;
                    int shift = 4 * (j % 2);
                    for (int i = 0; i < QBLOCK / 2; i++) {  /* groups 0..3 low, 4..7 high */
                        int lo = (nibbles[i] >> shift) & 15, hi = (nibbles[i + QBLOCK / 2] >> shift) & 15;
                        block[(i / 4) * Q4_CHUNK + r * 4 + i % 4] = (uint8_t)(lo | hi << 4);
                    }
                    for (int i = 0; i < QBLOCK; i++)  /* value i is byte r * 4 + i % 4 of group i / 4 */
                        high[r * 4 + i % 4] |= (uint8_t)(((qh[i] >> j) & 1) << (i / 4));
                    q4_k_scale_min(scales, j, block + Q4_NIBBLES + Q5_HIGH + r, mins + (j / 2) * TILE * 2 + r * 2 + j % 2);
                }
            }
        }
    }
}
GGUF_PACKER(q5k)

static void q5k_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                              int rows, float *out, const char *ahead, int64_t ahead_step) {
    (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b0 = 0; b0 < nb; b0 += Q5K_BLOCKS) {
            const uint8_t *head = kmin_head(tile, b0 / Q5K_BLOCKS, Q5K_SUPER_BYTES);
            int32_t s[TILE] = {0};
            for (int j = 0; j < Q5K_BLOCKS; j++) {
                const uint8_t *w = head + KMIN_HEAD + j * Q5K_BLOCK_BYTES, *high = w + Q4_NIBBLES, *sc = high + Q5_HIGH;
                const int8_t *x = xq + XQ(b0 + j, r);
                for (int lane = 0; lane < TILE; lane++) {
                    int32_t isum = 0;
                    for (int i = 0; i < QBLOCK; i++) {
                        int g = i / 4, at = lane * 4 + i % 4;
                        int nibble = (w[(g % 4) * Q4_CHUNK + at] >> (g < 4 ? 0 : 4)) & 15;
                        isum += (nibble | ((high[at] >> g) & 1) << 4) * x[i];
                    }
                    s[lane] += sc[lane] * isum;
                }
            }
            kmin_portable_super(head, s, xo + r, xs + r, b0, acc);
        }
        memcpy(out + r * TILE, acc, sizeof acc);
    }
}

#if defined(__x86_64__)

/* q5k on AVX2, also run for AVX-VNNI (same bits: the integer sums are exact either way). q is
0..31, the u8 operand of vpmaddubsw: a pair is at most 2 * 31 * 128 = 7936, so four groups' pairs
sum in int16 (31744 < 32767), and one vpmaddwd per four groups widens them times the block's sc (q5's
SMALL_Q5 way, without its offset). Both halves of the tile at once, for up to 3 rows. */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void q5k_avx2_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                 const float *xs, const int32_t *xo, int r0, float *out,
                                                                 const char *ahead, int64_t ahead_step, const int n) {
    const __m256i low = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
    memset(out + r0 * TILE, 0, (size_t)n * TILE * sizeof(float));
    for (int64_t b0 = 0; b0 < nb; b0 += Q5K_BLOCKS) {
        const uint8_t *head = kmin_head(tile, b0 / Q5K_BLOCKS, Q5K_SUPER_BYTES);
        __m256i s[3][2];
        UNROLLED for (int r = 0; r < n; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < Q5K_BLOCKS; j++) {
            const int64_t b = b0 + j;
            const uint8_t *w = head + KMIN_HEAD + j * Q5K_BLOCK_BYTES;
            if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
            UNROLLED for (int g0 = 0; g0 < GROUPS; g0 += 4) {  /* the low nibbles' groups, then the high ones' */
                __m256i sum16[3][2];
                UNROLLED for (int g = g0; g < g0 + 4; g++) {
                    __m256i u[2];
                    UNROLLED for (int h = 0; h < 2; h++) {
                        __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + (g % 4) * Q4_CHUNK + h * 32));
                        __m256i high = _mm256_loadu_si256((const __m256i *)(w + Q4_NIBBLES + h * 32));
                        __m256i nibbles = g < 4 ? pairs : _mm256_srli_epi16(pairs, 4);
                        __m256i bit = g < 4 ? _mm256_slli_epi16(high, 4 - g) : _mm256_srli_epi16(high, g - 4);
                        u[h] = _mm256_or_si256(_mm256_and_si256(nibbles, low), _mm256_and_si256(bit, fifth));
                    }
                    UNROLLED for (int r = 0; r < n; r++) {
                        __m256i x = _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g * 4));
                        __m256i p0 = _mm256_maddubs_epi16(u[0], x), p1 = _mm256_maddubs_epi16(u[1], x);
                        sum16[r][0] = g == g0 ? p0 : _mm256_add_epi16(sum16[r][0], p0);
                        sum16[r][1] = g == g0 ? p1 : _mm256_add_epi16(sum16[r][1], p1);
                        KEEP_IN_REGISTER(sum16[r][0]);
                        KEEP_IN_REGISTER(sum16[r][1]);
                    }
                }
                UNROLLED for (int h = 0; h < 2; h++) {
                    __m256i sc = kmin_scales_avx2(w + Q4_NIBBLES + Q5_HIGH, h);
                    UNROLLED for (int r = 0; r < n; r++) s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(sum16[r][h], sc));
                }
            }
        }
        kmin_avx2_super(head, s, xs, xo, b0, r0, out, n);
    }
}

__attribute__((target("avx2,fma,f16c")))
static void q5k_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                          int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(q5k_avx2_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step)
}

/* q5k on AVX512-VNNI: a block's groups as q5's, its sums times its sc add up S, as q4k's. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void q5k_vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                    const float *xs, const int32_t *xo, const int rows,
                                                                    float *out, const char *ahead, int64_t ahead_step) {
    __m512 acc[MAX_ROWS];
    UNROLLED for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += Q5K_BLOCKS) {
        const uint8_t *head = kmin_head(tile, b0 / Q5K_BLOCKS, Q5K_SUPER_BYTES);
        __m512i s[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        for (int j = 0; j < Q5K_BLOCKS; j++) {
            const int64_t b = b0 + j;
            const uint8_t *w = head + KMIN_HEAD + j * Q5K_BLOCK_BYTES;
            const int8_t *x = xq + XQ(b, 0);
            prefetch_ahead(ahead, ahead_step, b);
            __m512i isum[MAX_ROWS];
            UNROLLED for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
            q5_block_vnni512(w, x, isum, rows);
            __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + Q4_NIBBLES + Q5_HIGH)));
            UNROLLED for (int r = 0; r < rows; r++) s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(isum[r], sc));
        }
        kmin_vnni512_super(head, acc, s, xs, xo, b0, rows);
    }
    UNROLLED for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

VNNI512_TILE(q5k_tile_avx512vnni, q5k_vnni512_rows)

#endif

static tile_kernel q5k_kernel_for(int isa) {
#if defined(__x86_64__)
    switch (isa) {
        case ISA_AVX2: case ISA_AVXVNNI: return q5k_tile_avx2;
        case ISA_AVX512VNNI: return q5k_tile_avx512vnni;
    }
#endif
    return q5k_tile_portable;
}

const format Q5K = {q5k_tile_bytes, q5k_kernel_for, no_small_kernel, 0, kmin_pair_sums, 1};
