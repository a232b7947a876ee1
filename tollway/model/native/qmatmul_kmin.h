/* What Q4_K and Q5_K share (qmatmul_q4k.c, qmatmul_q5k.c): the superblock's head of d, dmin and
the m pairs, the 6-bit scales and mins of a file's superblock, and the float step every path
takes once a superblock; the block pairs' activation sums are kmin_pair_sums (qmatmul.h). */
#ifndef TOLLWAY_QMATMUL_KMIN_H
#define TOLLWAY_QMATMUL_KMIN_H

#include "qmatmul_simd.h"

#define Q4K_SUPER 256                                   /* values per superblock */
#define Q4K_BLOCKS (Q4K_SUPER / QBLOCK)                 /* blocks per superblock */
#define KMIN_HEAD (TILE * 4 + Q4K_BLOCKS * TILE)        /* a tile's d, dmin and m pairs of one superblock */
#define Q4K_BLOCK_BYTES (Q4_NIBBLES + TILE)             /* nibbles, then sc */
#define Q4K_SUPER_BYTES (KMIN_HEAD + Q4K_BLOCKS * Q4K_BLOCK_BYTES)
#define Q4_K_BYTES 144                                  /* the file's superblock: d, dmin, 12 bytes of scales, 128 of nibbles */
_Static_assert(Q4K_SUPER == SUPERBLOCK, "a superblock is the activations' span");

/* Block j's 6-bit scale and min from a Q4_K superblock's 12 bytes (GGUF's get_scale_min_k4). */
static inline void q4_k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Superblock s's head in a tile of q4k (or q5k, whose superblocks are super_bytes long): d, dmin, then the m pairs. */
static inline const uint8_t *kmin_head(const uint8_t *tile, int64_t s, int64_t super_bytes) {
    return tile + s * super_bytes;
}

/* Block j's sum of quantized activations, negated, from its xo (the pair of its block pair). */
static inline int32_t kmin_negated_sum(int32_t pair, int j) { return (int16_t)(j % 2 ? (uint32_t)pair >> 16 : (uint32_t)pair); }

/* A lane's superblock into its float output, as every path does it: S = sum sc isum, negm = -sum m s. */
static inline float kmin_add_super(float acc, uint16_t d, uint16_t dmin, int32_t s, int32_t negm, float xs) {
    return fmaf(fmaf(half_to_float(d), (float)s, half_to_float(dmin) * (float)negm), xs, acc);
}

/* The portable kernels' superblock: lane sums S and negated mins into out (one row's 16 lanes). */
static inline void kmin_portable_super(const uint8_t *head, const int32_t *s, const int32_t *xo_row, const float *xs_row,
                                int64_t b0, float *out) {
    const uint16_t *d = (const uint16_t *)head, *dmin = d + TILE;
    const uint8_t *mins = head + TILE * 4;
    for (int lane = 0; lane < TILE; lane++) {
        int32_t negm = 0;
        for (int j = 0; j < Q4K_BLOCKS; j++)
            negm += mins[(j / 2) * TILE * 2 + lane * 2 + j % 2] * kmin_negated_sum(xo_row[XS(b0 + j, 0)], j);
        out[lane] = kmin_add_super(out[lane], d[lane], dmin[lane], s[lane], negm, xs_row[XS(b0, 0)]);
    }
}

#if defined(__x86_64__)

/* The AVX2 kernels' superblock, for half h of the tile and rows r0..r0 + n: each row's S and the
   mins (m pairs times the rows' (-s, -s') pairs, one vpmaddwd per block pair) into its outputs in
   out, which hold the float sums between superblocks. */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void kmin_avx2_super(const uint8_t *head, __m256i s[3][2], const float *xs,
                                                                  const int32_t *xo, int64_t b0, int r0, float *out,
                                                                  const int n) {
    UNROLLED for (int h = 0; h < 2; h++) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + h * 16)));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + TILE * 2 + h * 16)));
        __m256i mins[Q4K_BLOCKS / 2];
        UNROLLED for (int p = 0; p < Q4K_BLOCKS / 2; p++)
            mins[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(head + TILE * 4 + p * TILE * 2 + h * 16)));
        UNROLLED for (int r = 0; r < n; r++) {
            __m256i negm = _mm256_setzero_si256();
            UNROLLED for (int p = 0; p < Q4K_BLOCKS / 2; p++)
                negm = _mm256_add_epi32(negm, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(xo[XS(b0 + 2 * p, r0 + r)])));
            __m256 t = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(negm)));
            float *o = out + (r0 + r) * TILE + h * 8;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(t, _mm256_set1_ps(xs[XS(b0, r0 + r)]), _mm256_loadu_ps(o)));
        }
    }
}

/* A block's 8 sc bytes of half h in both int16 of each lane, for vpmaddwd. */
__attribute__((target("avx2")))
static inline __m256i kmin_scales_avx2(const uint8_t *sc, int h) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + h * 8)));
    return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

/* The AVX512-VNNI kernels' superblock: each row's S and mins (one vpdpwssd per block pair) into acc. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void kmin_vnni512_super(const uint8_t *head, __m512 *acc, const __m512i *s,
                                                                     const float *xs, const int32_t *xo, int64_t b0,
                                                                     const int rows) {
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)head));
    __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + TILE * 2)));
    __m512i mins[Q4K_BLOCKS / 2];
    UNROLLED for (int p = 0; p < Q4K_BLOCKS / 2; p++)
        mins[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(head + TILE * 4 + p * TILE * 2)));
    UNROLLED for (int r = 0; r < rows; r++) {
        __m512i negm = _mm512_setzero_si512();
        UNROLLED for (int p = 0; p < Q4K_BLOCKS / 2; p++)
            negm = _mm512_dpwssd_epi32(negm, mins[p], _mm512_set1_epi32(xo[XS(b0 + 2 * p, r)]));
        __m512 t = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(negm)));
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(xs[XS(b0, r)]), acc[r]);
    }
}

#endif

#endif
