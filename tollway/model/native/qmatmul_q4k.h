/* q4k: a GGUF's Q4_K weights in their own 4.5 bits, laid out for qmatmul.c's kernels. Included by
qmatmul.c after its formats' common parts (tiles of 16 output rows, blocks of 32 along K, the
activations, the prefetching and the row switches).

Q4_K keeps superblocks of 256 values: an fp16 d and dmin, and per block of 32 a 6-bit scale sc and
min m, then 4-bit values q: w = d * sc * q - dmin * m. Here a tile keeps, per superblock, its 16
rows' d and dmin, then per block the nibbles as q5 keeps them (4 chunks of 64 bytes, chunk p
holding groups p and p + 4 as low and high nibbles, 16 rows x 4 bytes), then the 16 rows' sc and m
as bytes:

    tile t: [K / 256] x ([16] fp16 d, [16] fp16 dmin, [8] x ([4][16][4] u8 nibble pairs, [16] u8 sc, [16] u8 m))

4.625 bits a weight against the file's 4.5 (its 12 bytes of packed 6-bit scales become 16 bytes).
Every path computes a block's scale and min as GGUF's dequantization does, scale = d * sc and
min = dmin * m in float32, then sums acc = fma(scale * (float)isum - min * (float)xsum, xscale, acc)
with isum = dot(q, xq) exact in integers and xsum the block's sum of quantized activations. */

#define Q4K_SUPER 256                                   /* values per superblock */
#define Q4K_BLOCKS (Q4K_SUPER / QBLOCK)                 /* blocks per superblock */
#define Q4K_HEAD (TILE * 4)                             /* a tile's d and dmin of one superblock */
#define Q4K_BLOCK_BYTES (Q4_NIBBLES + TILE * 2)         /* nibbles, then sc and m */
#define Q4K_SUPER_BYTES (Q4K_HEAD + Q4K_BLOCKS * Q4K_BLOCK_BYTES)
#define Q4_K_BYTES 144                                  /* the file's superblock: d, dmin, 12 bytes of scales, 128 of nibbles */

static int64_t q4k_tile_bytes(int64_t k) { return k / Q4K_SUPER * Q4K_SUPER_BYTES; }

int64_t q4k_packed_bytes(int64_t n, int64_t k) { return (n + TILE - 1) / TILE * q4k_tile_bytes(k); }

/* Where block b's nibbles start in a tile, and its superblock's d. */
static inline const uint8_t *q4k_block(const uint8_t *tile, int64_t b) {
    return tile + b / Q4K_BLOCKS * Q4K_SUPER_BYTES + Q4K_HEAD + b % Q4K_BLOCKS * Q4K_BLOCK_BYTES;
}
static inline const uint16_t *q4k_head(const uint8_t *tile, int64_t b) {
    return (const uint16_t *)(tile + b / Q4K_BLOCKS * Q4K_SUPER_BYTES);
}

/* Block j's 6-bit scale and min from a Q4_K superblock's 12 bytes (GGUF's get_scale_min_k4). */
static void q4_k_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* Q4_K rows (n rows of k / 256 superblocks) -> tiles t0..t1 of q4k (q4k_packed_bytes(n, k) bytes at out). */
static void q4k_pack_tiles(const uint8_t *blocks, int64_t n, int64_t k, uint8_t *out, int64_t t0, int64_t t1) {
    int64_t supers = k / Q4K_SUPER;
    memset(out + t0 * q4k_tile_bytes(k), 0, (size_t)((t1 - t0) * q4k_tile_bytes(k)));  /* padding rows: zero scales and mins */
    for (int64_t t = t0; t < t1; t++) {
        for (int64_t s = 0; s < supers; s++) {
            uint8_t *super = out + t * q4k_tile_bytes(k) + s * Q4K_SUPER_BYTES;
            uint16_t *d = (uint16_t *)super, *dmin = d + TILE;
            for (int r = 0; r < TILE && t * TILE + r < n; r++) {
                const uint8_t *src = blocks + ((t * TILE + r) * supers + s) * Q4_K_BYTES;
                const uint8_t *scales = src + 4, *qs = src + 16;
                d[r] = read_u16(src);
                dmin[r] = read_u16(src + 2);
                for (int j = 0; j < Q4K_BLOCKS; j++) {
                    uint8_t *block = super + Q4K_HEAD + j * Q4K_BLOCK_BYTES;
                    /* block j is the low (j even) or high nibbles of the file's 32 bytes j / 2 */
                    const uint8_t *nibbles = qs + j / 2 * 32;
                    int shift = 4 * (j % 2);
                    for (int i = 0; i < QBLOCK / 2; i++) {  /* groups 0..3 low, 4..7 high */
                        int lo = (nibbles[i] >> shift) & 15, hi = (nibbles[i + QBLOCK / 2] >> shift) & 15;
                        block[(i / 4) * Q4_CHUNK + r * 4 + i % 4] = (uint8_t)(lo | hi << 4);
                    }
                    q4_k_scale_min(scales, j, block + Q4_NIBBLES + r, block + Q4_NIBBLES + TILE + r);
                }
            }
        }
    }
}
GGUF_PACKER(q4k)

static void q4k_tile_portable(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                              int rows, float *out, const char *ahead, int64_t ahead_step) {
    (void)ahead, (void)ahead_step;
    for (int r = 0; r < rows; r++) {
        float acc[TILE] = {0};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *w = q4k_block(tile, b), *sc = w + Q4_NIBBLES, *m = sc + TILE;
            const uint16_t *d = q4k_head(tile, b), *dmin = d + TILE;
            const int8_t *x = xq + XQ(b, r);
            float xsum = xsum_of(xo[XS(b, r)]);
            for (int lane = 0; lane < TILE; lane++) {
                int32_t isum = 0;
                for (int i = 0; i < QBLOCK / 2; i++) {
                    uint8_t pair = w[(i / 4) * Q4_CHUNK + lane * 4 + i % 4];
                    isum += (pair & 15) * x[i] + (pair >> 4) * x[i + QBLOCK / 2];
                }
                float scale = half_to_float(d[lane]) * (float)sc[lane], min = half_to_float(dmin[lane]) * (float)m[lane];
                float t = scale * (float)isum - min * xsum;
                acc[lane] = fmaf(t, xs[XS(b, r)], acc[lane]);
            }
        }
        memcpy(out + r * TILE, acc, sizeof acc);
    }
}

#if defined(__x86_64__)

/* The K-quants with a min (q4k, q5k) keep a block's 16 sc bytes then its 16 m bytes at `scm`, and
   their superblock's 16 fp16 d then 16 dmin at `d`. These are the lanes' scale (d * sc) and min
   (dmin * m): 8 of them, half h of the tile. */
__attribute__((target("avx2,fma,f16c")))
static inline void kmin_scales_avx2(const uint8_t *scm, const uint16_t *d, int h, __m256 *scale, __m256 *min) {
    __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scm + h * 8))));
    __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(scm + TILE + h * 8))));
    *scale = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + h * 8))), sc);
    *min = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + TILE + h * 8))), m);
}

/* Block b's integer sums into the rows' accumulators on AVX512-VNNI, for the K-quants with a min:
   acc = fma(d * sc * isum - dmin * m * xsum, xscale, acc) (d and dmin as floats, scm as above). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void kmin_add_block512(__m512 *acc, const __m512i *isum, __m512 d,
                                                                     __m512 dmin, const uint8_t *scm, const float *xs,
                                                                     const int32_t *xo, int64_t b, const int rows) {
    __m512 ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)scm))));
    __m512 wm = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(scm + TILE)))));
    UNROLLED for (int r = 0; r < rows; r++) {
        __m512 t = _mm512_sub_ps(_mm512_mul_ps(ws, _mm512_cvtepi32_ps(isum[r])),
                                 _mm512_mul_ps(wm, _mm512_set1_ps(xsum_of(xo[XS(b, r)]))));
        acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(xs[XS(b, r)]), acc[r]);
    }
}

/* q4k on AVX2, also run for AVX-VNNI (same bits: the integer sums are exact either way). q is
0..15, so vpmaddubsw takes it as the u8 operand directly, and a block's 16 products per int16 lane
stay within 16 * 15 * 128 < 32767: the block sums in int16 (vpaddw, which leaves the multiply
ports free), and one vpmaddwd a block widens it. Both halves of the tile at once, for up to 3 rows,
so that each broadcast activation group feeds two vpmaddubsw (a chunk's low nibbles, then its high
ones: two weight registers at a time). */
__attribute__((target("avx2,fma,f16c")))
static inline __attribute__((always_inline)) void q4k_avx2_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                 const float *xs, const int32_t *xo, int r0, float *out,
                                                                 const char *ahead, int64_t ahead_step, const int n) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 acc[3][2];
    UNROLLED for (int r = 0; r < n; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = q4k_block(tile, b);
        if (r0 == 0) prefetch_ahead_avx2(ahead, ahead_step, b);
        __m256i sum16[3][2];
        UNROLLED for (int g = 0; g < GROUPS; g++) {  /* chunk g % 4: its low nibbles are group g < 4, its high g >= 4 */
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
        UNROLLED for (int h = 0; h < 2; h++) {
            __m256 ws, wm;
            kmin_scales_avx2(w + Q4_NIBBLES, q4k_head(tile, b), h, &ws, &wm);
            UNROLLED for (int r = 0; r < n; r++) {
                __m256i isum = _mm256_madd_epi16(sum16[r][h], ones);
                __m256 t = _mm256_sub_ps(_mm256_mul_ps(ws, _mm256_cvtepi32_ps(isum)),
                                         _mm256_mul_ps(wm, _mm256_set1_ps(xsum_of(xo[XS(b, r0 + r)]))));
                acc[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(xs[XS(b, r0 + r)]), acc[r][h]);
            }
        }
    }
    store_rows(out, acc, r0, n);
}

__attribute__((target("avx2,fma,f16c")))
static void q4k_tile_avx2(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                          int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int r0 = 0; r0 < rows; r0 += 3)
        ROWS3_SWITCH(q4k_avx2_rows, rows - r0, tile, nb, xq, xs, xo, r0, out, ahead, ahead_step)
}

/* q4k on AVX512-VNNI: each 64-byte chunk gives two groups, its low and its high nibbles. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
static inline __attribute__((always_inline)) void q4k_vnni512_rows(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                    const float *xs, const int32_t *xo, const int rows,
                                                                    float *out, const char *ahead, int64_t ahead_step) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[MAX_ROWS];
    UNROLLED for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    __m512 d = _mm512_setzero_ps(), dmin = d;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = q4k_block(tile, b);
        const int8_t *x = xq + XQ(b, 0);
        prefetch_ahead(ahead, ahead_step, b);
        if (b % Q4K_BLOCKS == 0) {
            const uint16_t *head = q4k_head(tile, b);
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)head));
            dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(head + TILE)));
        }
        __m512i isum[MAX_ROWS];
        UNROLLED for (int r = 0; r < rows; r++) isum[r] = _mm512_setzero_si512();
        UNROLLED for (int p = 0; p < 4; p++) {
            __m512i pairs = _mm512_loadu_si512(w + p * Q4_CHUNK);
            __m512i lo = _mm512_and_si512(pairs, low), hi = _mm512_and_si512(_mm512_srli_epi16(pairs, 4), low);
            UNROLLED for (int r = 0; r < rows; r++) {
                isum[r] = dpbusd_broadcast(isum[r], lo, x + r * QBLOCK + p * 4);
                isum[r] = dpbusd_broadcast(isum[r], hi, x + r * QBLOCK + (p + 4) * 4);
            }
        }
        kmin_add_block512(acc, isum, d, dmin, w + Q4_NIBBLES, xs, xo, b, rows);
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

static const format Q4K = {q4k_tile_bytes, q4k_kernel_for, no_small_kernel, 0};
