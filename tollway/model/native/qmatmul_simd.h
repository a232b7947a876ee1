/* The SIMD pieces the kernel files (qmatmul_kernels.c and each format's) inline: the weights'
read-ahead, the row switches, and the blocks of 4- and 5-bit values every nibble format shares. */
#ifndef TOLLWAY_QMATMUL_SIMD_H
#define TOLLWAY_QMATMUL_SIMD_H

#include "qmatmul.h"

/* Only the sources with SIMD code include the intrinsics: parsing them is a third of a small
   source's compile. */
#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

#endif

#endif
