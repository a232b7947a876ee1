/* The kernels of q8, q5 and the signed tiles (qmatmul.h), per instruction set, and their formats:
`rows` activation rows through one tile, 16 float outputs per row. Arguments: the tile, nb, a group
of quantized rows (values, scales, offsets), the row count (1..MAX_ROWS), and out[rows][16]. */
#include "qmatmul_simd.h"

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

tile_kernel no_small_kernel(int isa) {
    (void)isa;
    return NULL;
}

/* Whether `isa` has a faster kernel for small values: where a pruned argmax pays. */
int q8_has_small_kernel(int isa) { return q8_small_kernel_for(isa) != NULL; }

tile_kernel signed_kernel_for(int isa) {
#if defined(__x86_64__)
    if (isa != ISA_PORTABLE) return signed_tile_avx2;
#endif
    (void)isa;
    return signed_tile_portable;
}

const format Q8 = {q8_tile_bytes, q8_kernel_for, q8_small_kernel_for, 0},
                    Q5 = {q5_tile_bytes, q5_kernel_for, no_small_kernel, 0},
                    SIGNED = {signed_tile_bytes, signed_kernel_for, no_small_kernel, 1};
