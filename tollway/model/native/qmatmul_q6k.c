/* q6k: a GGUF's Q6_K weights in their own 6.5625 bits, laid out for the matmul's tiles of 16
output rows and blocks of 32 along K (qmatmul.h), with its kernels.

Q6_K keeps superblocks of 256 values: 6-bit values q (128 bytes of low nibbles, 64 of high bit
pairs), an int8 scale per 16 values and an fp16 d: w = d * sc * (q - 32). Here a tile keeps, per
superblock, its 16 rows' d, then per block of 32 the low nibbles as q4k keeps them (4 chunks of 64
bytes, chunk p holding groups p and p + 4 as low and high nibbles, 16 rows x 4 bytes), the high bit
pairs (2 x 64 bytes: bits 2i..2i+1 of byte j of part h are the high bits of byte j of group 4h + i's
64 bytes, the 16-rows-x-4-bytes order), then each row's two scales, sc0 (values 0..15, the chunks'
low nibbles) and sc1 (values 16..31, their high nibbles):

    tile t: [K / 256] x ([16] fp16 d, [8] x ([4][16][4] u8 nibble pairs, [2][16][4] u8 high bits, [16][2] s8 sc))

3360 bytes per 16 x 256 weights: 6.5625 bits a weight, the file's own. The activations take one
scale xs per superblock (the format's superblock_scales), so a superblock sums in integers, exactly,
on every path: S = sum over its blocks of sc0 * dot(q - 32, x[0:16]) + sc1 * dot(q - 32, x[16:32])
(each block within 2^24, S and every partial sum within 2^29), and meets floats once: acc =
fma((float)S, d * xs, acc). The -32 takes each half block's sum of quantized activations: a pass
after quantizing (q6k_half_sums, the format's activation_sums) writes them, negated, as two int16
into xo's slot of the block (low: values 0..15, high: 16..31), in place of q8's -128 x the block's
sum. */
#include "qmatmul_simd.h"

#define Q6K_SUPER 256                                   /* values per superblock */
#define Q6K_BLOCKS (Q6K_SUPER / QBLOCK)                 /* blocks per superblock */
#define Q6K_HEAD (TILE * 2)                             /* a tile's fp16 d of one superblock */
#define Q6K_HIGH (TILE * QBLOCK / 4)                    /* high bit pairs of one tile and block */
#define Q6K_BLOCK_BYTES (Q4_NIBBLES + Q6K_HIGH + TILE * 2)  /* nibbles, high bits, then sc0 and sc1 per row */
#define Q6K_SUPER_BYTES (Q6K_HEAD + Q6K_BLOCKS * Q6K_BLOCK_BYTES)
#define Q6K_OFFSET 32                                   /* w = d * sc * (q - 32) */
#define Q6_K_BYTES 210  /* the file's superblock: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, fp16 d */

static int64_t q6k_tile_bytes(int64_t k) { return k / Q6K_SUPER * Q6K_SUPER_BYTES; }

int64_t q6k_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q6k_tile_bytes(k); }

/* Where block b's nibbles start in a tile, and its superblock's d. */
static inline const uint8_t *q6k_block(const uint8_t *tile, int64_t b) {
    return tile + b / Q6K_BLOCKS * Q6K_SUPER_BYTES + Q6K_HEAD + b % Q6K_BLOCKS * Q6K_BLOCK_BYTES;
}
static inline const uint16_t *q6k_head(const uint8_t *tile, int64_t b) {
    return (const uint16_t *)(tile + b / Q6K_BLOCKS * Q6K_SUPER_BYTES);
}

/* Q6_K rows (n rows of k / 256 superblocks) -> tiles t0..t1 of q6k (q6k_packed_bytes(n, k) bytes at out). In the
   file, value 128 h + 32 j + l (h < 2, j < 4, l < 32) has its low 4 bits in byte 64 h + 32 (j % 2) + l
   of the nibbles (the high nibble for j >= 2), its high 2 bits at bit 2 j of byte 32 h + l of the
   high bit pairs, and its scale in byte (128 h + 32 j + l) / 16 of the scales (gguf-py's
   dequantize_blocks for Q6_K). */
static void q6k_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t supers = k / Q6K_SUPER;
    memset(out + t0 * q6k_tile_bytes(k), 0, (size_t)((t1 - t0) * q6k_tile_bytes(k)));  /* padding rows: zero d and scales */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *super = out + t * q6k_tile_bytes(k) + s * Q6K_SUPER_BYTES;
            uint16_t *d = (uint16_t *)super;
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const uint8_t *src = blocks + ((t * TILE + r) * supers + s) * Q6_K_BYTES;
                const uint8_t *ql = src, *qh = src + 128, *sc = src + 192;
                d[r] = read_u16(src + 208);
                for (int j = 0; j < Q6K_BLOCKS; j++) {  /* block j: the file's h = j / 4 and j % 4 */
                    uint8_t *block = super + Q6K_HEAD + j * Q6K_BLOCK_BYTES, *high = block + Q4_NIBBLES;
                    const uint8_t *nibbles = ql + j / 4 * 64 + (j % 2) * 32, *pairs = qh + j / 4 * 32;
                    int nshift = 4 * (j % 4 / 2), hshift = 2 * (j % 4);
                    uint8_t q[QBLOCK];
                    for (int i = 0; i < QBLOCK; i++) q[i] = (uint8_t)(((nibbles[i] >> nshift) & 15) | ((pairs[i] >> hshift) & 3) << 4);
                    for (int i = 0; i < QBLOCK / 2; i++)  /* groups 0..3 low, 4..7 high */
                        block[(i / 4) * Q4_CHUNK + r * 4 + i % 4] = (uint8_t)((q[i] & 15) | (q[i + QBLOCK / 2] & 15) << 4);
                    for (int part = 0; part < 2; part++)  /* groups 4 part .. 4 part + 3, 2 bits each */
                        for (int c = 0; c < 4; c++) {
                            const uint8_t *v = q + part * 16 + c;
                            high[part * Q4_CHUNK + r * 4 + c] =
                                (uint8_t)(v[0] >> 4 | (v[4] >> 4) << 2 | (v[8] >> 4) << 4 | (v[12] >> 4) << 6);
                        }
                    block[Q4_NIBBLES + Q6K_HIGH + r * 2] = sc[j * 2];
                    block[Q4_NIBBLES + Q6K_HIGH + r * 2 + 1] = sc[j * 2 + 1];
                }
            }
        }
    }
}
GGUF_PACKER(q6k)

/* ---- the half blocks' sums of activations (the format's activation_sums) ---- */

typedef struct { const int8_t *xq; int32_t *xo; int64_t m, k; } q6k_sums_job;

static void q6k_sums_part(void *ctx, int part, int parts) {
    q6k_sums_job *j = ctx;
    int64_t nb = j->k / QBLOCK;
    for (int64_t r = j->m * part / parts; r < j->m * (part + 1) / parts; r++) {  /* row r % MAX_ROWS of its group */
        int64_t group = r / MAX_ROWS * MAX_ROWS, i = r % MAX_ROWS;
        const int8_t *xq = j->xq + group * j->k;
        int32_t *xo = j->xo + group * nb;
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *x = xq + XQ(b, i);
            int32_t s[2];
            for (int h = 0; h < 2; h++) {
#if defined(__x86_64__)  /* SSE2, every x86-64's: the bytes + 128 summed by psadbw, 8 at a time */
                __m128i u = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(x + h * 16)), _mm_set1_epi8((char)0x80));
                __m128i sad = _mm_sad_epu8(u, _mm_setzero_si128());
                s[h] = _mm_cvtsi128_si32(sad) + _mm_extract_epi16(sad, 4) - 16 * 128;
#else
                s[h] = 0;
                for (int v = 0; v < QBLOCK / 2; v++) s[h] += x[h * 16 + v];
#endif
            }
            xo[XS(b, i)] = (int32_t)((uint32_t)(uint16_t)(int16_t)-s[0] | (uint32_t)(uint16_t)(int16_t)-s[1] << 16);
        }
    }
}

/* xo[XS(b, r)] = -s0 (low int16) and -s1 (high int16), s0 and s1 the sums of row r's quantized
   activations 0..15 and 16..31 of block b (each within +-16 x 127). */
static void q6k_half_sums(const int8_t *xq, int32_t *xo, int64_t m, int64_t k, int threads) {
    q6k_sums_job j = {xq, xo, m, k};
    if (m * k >= QUANTIZE_PARALLEL)
        run_parallel(threads, q6k_sums_part, &j);
    else
        q6k_sums_part(&j, 0, 1);
}

/* ---- the kernels ---- */

static void q6k_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                              int rows, float *out, const char *ahead, int64_t ahead_step) {
    (void)xo, (void)ahead, (void)ahead_step;  /* the half sums come from the values themselves here */
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b0 = 0; b0 < nb; b0 += Q6K_BLOCKS) {
            int32_t s[TILE] = {0};
            for (int64_t b = b0; b < b0 + Q6K_BLOCKS; b++) {
                const uint8_t *w = q6k_block(tile, b), *high = w + Q4_NIBBLES;
                const int8_t *sc = (const int8_t *)(high + Q6K_HIGH);
                const int8_t *x = xq + XQ(b, r);
                for (int lane = 0; lane < TILE; lane++) {
                    int32_t half[2] = {0, 0};
                    for (int i = 0; i < QBLOCK; i++) {
                        int g = i / 4, at = lane * 4 + i % 4;
                        int q = ((w[(g % 4) * Q4_CHUNK + at] >> (4 * (g / 4))) & 15) |
                                ((high[(g / 4) * Q4_CHUNK + at] >> (2 * (g % 4))) & 3) << 4;
                        half[g / 4] += (q - Q6K_OFFSET) * x[i];
                    }
                    s[lane] += sc[lane * 2] * half[0] + sc[lane * 2 + 1] * half[1];
                }
            }
            const uint16_t *d = q6k_head(tile, b0);
            for (int lane = 0; lane < TILE; lane++)
                acc[lane] = fmaf((float)s[lane], half_to_float(d[lane]) * xs[XS(b0, r)], acc[lane]);
        }
        memcpy(out + r * TILE, acc, sizeof acc);
    }
}

#if defined(__x86_64__)

/* Group g's 6-bit values (bytes, 0..63) for 32 bytes of a tile's 64-byte group order (at `at`, 0 or
   32): the nibble of chunk g % 4, or-ed with its high bits moved from bits 2 (g % 4) to bits 4..5.
   The 16-bit shifts move bits across bytes only into bits the masks clear. */
__attribute__((target("avx2")))
static inline __m256i q6k_group_avx2(const uint8_t *w, int g, int at) {
    const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    __m256i pairs = _mm256_loadu_si256((const __m256i *)(w + (g % 4) * Q4_CHUNK + at));
    __m256i high = _mm256_loadu_si256((const __m256i *)(w + Q4_NIBBLES + (g / 4) * Q4_CHUNK + at));
    __m256i nibbles = _mm256_and_si256(g < 4 ? pairs : _mm256_srli_epi16(pairs, 4), low);
    int p = g % 4;
    __m256i bits = p == 0 ? _mm256_slli_epi16(high, 4) : p == 1 ? _mm256_slli_epi16(high, 2)
                   : p == 2 ? high : _mm256_srli_epi16(high, 2);
    return _mm256_or_si256(nibbles, _mm256_and_si256(bits, top));
}

/* q6k on AVX2, also run for AVX-VNNI (same bits: the integer sums are exact either way). q is 0..63,
the u8 operand of vpmaddubsw: a pair of products is within 2 * 63 * 127 = 16002 in int16, so two
groups sum in int16 (vpaddw), and vpmaddwd widens each such sum times the sub-block's scale (a
column's sc0 or sc1 in both int16 of its lane): sc * 32004 x 2 stays far inside int32. Each row and
half of the tile starts from -32 (sc0 s0 + sc1 s1): one vpmaddwd of the (sc0, sc1) pairs with the
row's broadcast (-s0, -s1), shifted by 5. Both halves of the tile at once, for up to 3 rows, so that
each broadcast activation group feeds two vpmaddubsw: faster than 2 rows at a time from 8 rows on,
alike below (K12). */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void q6k_avx2_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                 const float *xs, const int32_t *xo, int r0, float *out,
                                                                 const char *ahead, int64_t ahead_step, const int n) {
    __m256 acc[3][2];
    UNROLLED for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += Q6K_BLOCKS) {
        __m256i isum[3][2];
        UNROLLED for (int r = 0; r < n; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
        for (int64_t b = b0; b < b0 + Q6K_BLOCKS; b++) {
            const uint8_t *w = q6k_block(tile, b);
            const uint8_t *scales = w + Q4_NIBBLES + Q6K_HIGH;
            if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
            UNROLLED for (int h = 0; h < 2; h++) {
                /* lane j: (sc0, sc1) of row 8 h + j as int16 */
                __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scales + h * 16)));
                UNROLLED for (int r = 0; r < n; r++) {
                    __m256i offset = _mm256_madd_epi16(pairs, _mm256_set1_epi32(xo[XS(b, r0 + r)]));
                    isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_slli_epi32(offset, 5));
                    KEEP_IN_REGISTER(isum[r][h]);
                }
            }
            UNROLLED for (int g0 = 0; g0 < GROUPS; g0 += 2) {  /* groups 0..3: sub-block 0, 4..7: sub-block 1 */
                UNROLLED for (int h = 0; h < 2; h++) {
                    /* each column's sc0 (groups 0..3) or sc1 (4..7) in both int16 of its lane */
                    __m256i pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(scales + h * 16)));
                    __m256i scale = g0 < 4 ? _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xa0), 0xa0)
                                           : _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(pairs, 0xf5), 0xf5);
                    __m256i w0 = q6k_group_avx2(w, g0, h * 32), w1 = q6k_group_avx2(w, g0 + 1, h * 32);
                    UNROLLED for (int r = 0; r < n; r++) {
                        __m256i x0 = _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g0 * 4));
                        __m256i x1 = _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g0 * 4 + 4));
                        __m256i sum16 = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
                        isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(sum16, scale));
                        KEEP_IN_REGISTER(isum[r][h]);
                    }
                }
            }
        }
        add_block(acc, isum, q6k_head(tile, b0), xs, b0, r0, n);
    }
    store_rows(out, acc, r0, n);
}

__attribute__((target("avx2,fma,f16c")))
static void q6k_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                          int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(q6k_avx2_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step)
}

/* q6k on AVX512-VNNI: each 64-byte chunk gives two groups, its low nibbles (sub-block 0) and its high
   ones (sub-block 1), each or-ed with its high bits; a row's two sub-blocks sum apart, and S takes
   each times its scale (vpmulld), and -32 (sc0 s0 + sc1 s1) in one vpdpwssd of the (32 sc0, 32 sc1)
   pairs with the row's (-s0, -s1). The float outputs wait in `out` between superblocks. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void q6k_vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                    const float *xs, const int32_t *xo, const int rows,
                                                                    float *out, const char *ahead, int64_t ahead_step) {
    const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    UNROLLED for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * TILE, _mm512_setzero_ps());
    for (int64_t b0 = 0; b0 < nb; b0 += Q6K_BLOCKS) {
        __m512i s[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) s[r] = _mm512_setzero_si512();
        for (int64_t b = b0; b < b0 + Q6K_BLOCKS; b++) {
            const uint8_t *w = q6k_block(tile, b);
            const int8_t *x = xq + XQ(b, 0);
            prefetch_ahead(ahead, ahead_step, b);
            const __m512i high0 = _mm512_loadu_si512(w + Q4_NIBBLES), high1 = _mm512_loadu_si512(w + Q4_NIBBLES + Q4_CHUNK);
            __m512i isum0[MAX_ROWS], isum1[MAX_ROWS];
            UNROLLED for (int r = 0; r < rows; r++) isum0[r] = isum1[r] = _mm512_setzero_si512();
            UNROLLED for (int p = 0; p < 4; p++) {
                __m512i pairs = _mm512_loadu_si512(w + p * Q4_CHUNK);
                __m512i bits0 = p == 0 ? _mm512_slli_epi16(high0, 4) : p == 1 ? _mm512_slli_epi16(high0, 2)
                                : p == 2 ? high0 : _mm512_srli_epi16(high0, 2);
                __m512i bits1 = p == 0 ? _mm512_slli_epi16(high1, 4) : p == 1 ? _mm512_slli_epi16(high1, 2)
                                : p == 2 ? high1 : _mm512_srli_epi16(high1, 2);
                __m512i lo = _mm512_or_si512(_mm512_and_si512(pairs, low), _mm512_and_si512(bits0, top));
                __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(pairs, 4), low), _mm512_and_si512(bits1, top));
                UNROLLED for (int r = 0; r < rows; r++) {
                    isum0[r] = dpbusd_broadcast(isum0[r], lo, x + r * QBLOCK + p * 4);
                    isum1[r] = dpbusd_broadcast(isum1[r], hi, x + r * QBLOCK + (p + 4) * 4);
                }
            }
            __m512i sc = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + Q4_NIBBLES + Q6K_HIGH)));
            __m512i sc0 = _mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 16), sc1 = _mm512_srai_epi32(sc, 16);
            __m512i sc32 = _mm512_slli_epi16(sc, 5);  /* within int16: |sc| <= 128 */
            UNROLLED for (int r = 0; r < rows; r++) {
                __m512i v = _mm512_dpwssd_epi32(s[r], sc32, _mm512_set1_epi32(xo[XS(b, r)]));
                s[r] = _mm512_add_epi32(_mm512_add_epi32(v, _mm512_mullo_epi32(isum0[r], sc0)),
                                        _mm512_mullo_epi32(isum1[r], sc1));
            }
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)q6k_head(tile, b0)));
        UNROLLED for (int r = 0; r < rows; r++) {
            __m512 o = _mm512_loadu_ps(out + r * TILE);
            _mm512_storeu_ps(out + r * TILE, _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]), _mm512_mul_ps(d, _mm512_set1_ps(xs[XS(b0, r)])), o));
        }
    }
}

VNNI512_TILE(q6k_tile_avx512vnni, q6k_vnni512_rows)

#endif

static tile_kernel q6k_kernel_for(int isa) {
#if defined(__x86_64__)
    switch (isa) {
        case ISA_AVX2: case ISA_AVXVNNI: return q6k_tile_avx2;
        case ISA_AVX512VNNI: return q6k_tile_avx512vnni;
    }
#endif
    return q6k_tile_portable;
}

const format Q6K = {q6k_tile_bytes, q6k_kernel_for, no_small_kernel, 0, q6k_half_sums, 1};
