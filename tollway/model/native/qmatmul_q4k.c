/* q4k: a GGUF's Q4_K weights in their own 4.5 bits, laid out for the matmul's tiles of 16 output
rows and blocks of 32 along K (qmatmul.h), with its kernels.

Q4_K keeps superblocks of 256 values: an fp16 d and dmin, and per block of 32 a 6-bit scale sc and
min m, then 4-bit values q: w = d * sc * q - dmin * m. Here a tile keeps, per superblock, its 16
rows' d and dmin and the mins of its 8 blocks in pairs (row r's m of blocks 2p and 2p + 1 side by
side, so that one int16 multiply-add takes both), then per block the nibbles as q5 keeps them (4
chunks of 64 bytes, chunk p holding groups p and p + 4 as low and high nibbles, 16 rows x 4 bytes)
and the 16 rows' sc as bytes:

    tile t: [K / 256] x ([16] fp16 d, [16] fp16 dmin, [4][16][2] u8 m, [8] x ([4][16][4] u8 nibble pairs, [16] u8 sc))

4.625 bits a weight against the file's 4.5 (its 12 bytes of packed 6-bit scales become 16 bytes).
The activations take one scale xs per superblock (the format's superblock_scales), so a superblock
sums in integers, exactly, on every path: S = sum_j sc_j dot(q_j, x_j) (|S| < 2^31) and M = sum_j
m_j s_j, s_j block j's sum of quantized activations, and meets floats once: acc = fma(fma(d, S,
dmin * -M), xs, acc), d * sc * q - dmin * m being gguf's weights with nothing rounded. The
format's activation_sums pass leaves in each block's xo the pair (-s_j, -s_j') of its block pair as
two int16 (block 2p's low), which the kernels multiply with the m pairs. */
#include "qmatmul_kmin.h"

static int64_t q4k_tile_bytes(int64_t k) { return k / Q4K_SUPER * Q4K_SUPER_BYTES; }

int64_t q4k_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q4k_tile_bytes(k); }


/* Q4_K rows (n rows of k / 256 superblocks) -> tiles t0..t1 of q4k (q4k_packed_bytes(n, k) bytes at out). */
static void q4k_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t supers = k / Q4K_SUPER;
    memset(out + t0 * q4k_tile_bytes(k), 0, (size_t)((t1 - t0) * q4k_tile_bytes(k)));  /* padding rows: zero scales and mins */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *super = out + t * q4k_tile_bytes(k) + s * Q4K_SUPER_BYTES;
            uint16_t *d = (uint16_t *)super, *dmin = d + TILE;
            uint8_t *mins = super + TILE * 4;
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const uint8_t *src = blocks + ((t * TILE + r) * supers + s) * Q4_K_BYTES;
                const uint8_t *scales = src + 4, *qs = src + 16;
                d[r] = read_u16(src);
                dmin[r] = read_u16(src + 2);
                for (int j = 0; j < Q4K_BLOCKS; j++) {
                    uint8_t *block = super + KMIN_HEAD + j * Q4K_BLOCK_BYTES;
                    /* block j is the low (j even) or high nibbles of the file's 32 bytes j / 2 */
                    const uint8_t *nibbles = qs + j / 2 * 32;
                    int shift = 4 * (j % 2);
                    for (int i = 0; i < QBLOCK / 2; i++) {  /* groups 0..3 low, 4..7 high */
                        int lo = (nibbles[i] >> shift) & 15, hi = (nibbles[i + QBLOCK / 2] >> shift) & 15;
                        block[(i / 4) * Q4_CHUNK + r * 4 + i % 4] = (uint8_t)(lo | hi << 4);
                    }
                    q4_k_scale_min(scales, j, block + Q4_NIBBLES + r, mins + (j / 2) * TILE * 2 + r * 2 + j % 2);
                }
            }
        }
    }
}
GGUF_PACKER(q4k)

typedef struct { int32_t *xo; int64_t m, k; } kmin_sums_job;

static void kmin_sums_part(void *ctx, int part, int parts) {
    kmin_sums_job *j = ctx;
    int64_t nb = j->k / QBLOCK;
    for (int64_t r = j->m * part / parts; r < j->m * (part + 1) / parts; r++) {  /* row r % MAX_ROWS of its group */
        int32_t *xo = j->xo + r / MAX_ROWS * MAX_ROWS * nb;
        int64_t i = r % MAX_ROWS;
        for (int64_t b = 0; b < nb; b += 2) {  /* xo = -128 s: -s is xo / 128, within +-32 x 127 */
            int32_t pair = (int32_t)((uint32_t)(uint16_t)(int16_t)(xo[XS(b, i)] / 128) |
                                     (uint32_t)(uint16_t)(int16_t)(xo[XS(b + 1, i)] / 128) << 16);
            xo[XS(b, i)] = xo[XS(b + 1, i)] = pair;
        }
    }
}

/* The format's activation_sums for Q4_K and Q5_K: each block's xo becomes (-s_2p, -s_2p+1), its
   block pair's sums of quantized activations negated, as two int16. */
void kmin_pair_sums(const int8_t *xq, int32_t *xo, int64_t m, int64_t k, int threads) {
    (void)xq;
    kmin_sums_job j = {xo, m, k};
    if (m * k >= QUANTIZE_PARALLEL)
        run_parallel(threads, kmin_sums_part, &j);
    else
        kmin_sums_part(&j, 0, 1);
}


static void q4k_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                              int rows, float *out, const char *ahead, int64_t ahead_step) {
    (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b0 = 0; b0 < nb; b0 += Q4K_BLOCKS) {
            const uint8_t *head = kmin_head(tile, b0 / Q4K_BLOCKS, Q4K_SUPER_BYTES);
            int32_t s[TILE] = {0};
            for (int j = 0; j < Q4K_BLOCKS; j++) {
                const uint8_t *w = head + KMIN_HEAD + j * Q4K_BLOCK_BYTES, *sc = w + Q4_NIBBLES;
                const int8_t *x = xq + XQ(b0 + j, r);
                for (int lane = 0; lane < TILE; lane++) {
                    int32_t isum = 0;
                    for (int i = 0; i < QBLOCK / 2; i++) {
                        uint8_t pair = w[(i / 4) * Q4_CHUNK + lane * 4 + i % 4];
                        isum += (pair & 15) * x[i] + (pair >> 4) * x[i + QBLOCK / 2];
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


/* q4k on AVX2, also run for AVX-VNNI (same bits: the integer sums are exact either way): a block
sums in int16 (nibble_block_avx2), and one vpmaddwd widens it times the block's sc. */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void q4k_avx2_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                 const float *xs, const int32_t *xo, int r0, float *out,
                                                                 const char *ahead, int64_t ahead_step, const int n) {
    memset(out + r0 * TILE, 0, (size_t)n * TILE * sizeof(float));
    for (int64_t b0 = 0; b0 < nb; b0 += Q4K_BLOCKS) {
        const uint8_t *head = kmin_head(tile, b0 / Q4K_BLOCKS, Q4K_SUPER_BYTES);
        __m256i s[3][2];
        UNROLLED for (int r = 0; r < n; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < Q4K_BLOCKS; j++) {
            const int64_t b = b0 + j;
            const uint8_t *w = head + KMIN_HEAD + j * Q4K_BLOCK_BYTES;
            if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
            __m256i sum16[3][2];
            nibble_block_avx2(w, xq, b, r0, sum16, n);
            UNROLLED for (int h = 0; h < 2; h++) {
                __m256i sc = kmin_scales_avx2(w + Q4_NIBBLES, h);
                UNROLLED for (int r = 0; r < n; r++) s[r][h] = _mm256_add_epi32(s[r][h], _mm256_madd_epi16(sum16[r][h], sc));
            }
        }
        kmin_avx2_super(head, s, xs, xo, b0, r0, out, n);
    }
}

__attribute__((target("avx2,fma,f16c")))
static void q4k_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                          int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(q4k_avx2_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step)
}


/* q4k on AVX512-VNNI: a block's sums (nibble_block_vnni512) times its sc (vpmulld) add up the
   superblock's S. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void q4k_vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                    const float *xs, const int32_t *xo, const int rows,
                                                                    float *out, const char *ahead, int64_t ahead_step) {
    __m512 acc[MAX_ROWS];
    UNROLLED for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += Q4K_BLOCKS) {
        const uint8_t *head = kmin_head(tile, b0 / Q4K_BLOCKS, Q4K_SUPER_BYTES);
        __m512i s[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        for (int j = 0; j < Q4K_BLOCKS; j++) {
            const int64_t b = b0 + j;
            const uint8_t *w = head + KMIN_HEAD + j * Q4K_BLOCK_BYTES;
            const int8_t *x = xq + XQ(b, 0);
            prefetch_ahead(ahead, ahead_step, b);
            __m512i isum[MAX_ROWS];
            UNROLLED for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
            nibble_block_vnni512(w, x, isum, rows);
            __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + Q4_NIBBLES)));
            UNROLLED for (int r = 0; r < rows; r++) s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(isum[r], sc));
        }
        kmin_vnni512_super(head, acc, s, xs, xo, b0, rows);
    }
    UNROLLED for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE, acc[r]);
}

VNNI512_TILE(q4k_tile_avx512vnni, q4k_vnni512_rows)

#endif

static tile_kernel q4k_kernel_for(int isa) {
#if defined(__x86_64__)
    switch (isa) {
        case ISA_AVX2: case ISA_AVXVNNI: return q4k_tile_avx2;
        case ISA_AVX512VNNI: return q4k_tile_avx512vnni;
    }
#endif
    return q4k_tile_portable;
}

const format Q4K = {q4k_tile_bytes, q4k_kernel_for, no_small_kernel, 0, kmin_pair_sums, 1};

