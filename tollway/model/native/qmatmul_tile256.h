/* The 256-bit VNNI q8 tile kernel, included by qmatmul_kernels.c once per encoding of its dot-product
   instruction: TILE256 names it, TILE256_ROWS its body for n rows, TILE256_TARGET its instruction
   sets, and DOT256(isum, w, x) adds one row's u8 x s8 group dot product. Each block's sums start at
   -128 * the activations' sum, for the weights' +128. A tile's 16 output rows are two halves of 8
   lanes. */
__attribute__((target(TILE256_TARGET)))
static inline __attribute__((always_inline)) void TILE256_ROWS(const uint8_t *tile, int64_t nb, const int8_t *xq,
                                                                const float *xs, const int32_t *xo, int half,
                                                                int r0, float *out, const char *ahead,
                                                                int64_t ahead_step, const int n) {
    const uint16_t *scales = (const uint16_t *)(tile + nb * BLOCK_BYTES);
    __m256 acc[4];
    UNROLLED for (int r = 0; r < n; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = tile + b * BLOCK_BYTES + half * 32;
        if (half == 0 && r0 == 0) prefetch_ahead(ahead, ahead_step, b);
        __m256i isum[4];
        UNROLLED for (int r = 0; r < n; r++)
            isum[r] = _mm256_set1_epi32(xo[XS(b, r0 + r)]);
        UNROLLED for (int g = 0; g < GROUPS; g++) {
            __m256i wg = _mm256_loadu_si256((const __m256i *)(w + g * 64));
            UNROLLED for (int r = 0; r < n; r++) {
                isum[r] = DOT256(isum[r], wg, _mm256_set1_epi32(group_of(xq + XQ(b, r0 + r) + g * 4)));
                KEEP_IN_REGISTER(isum[r]);
            }
        }
        __m256 ws = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + b * TILE + half * 8)));
        UNROLLED for (int r = 0; r < n; r++) {
            __m256 s = _mm256_mul_ps(ws, _mm256_set1_ps(xs[XS(b, r0 + r)]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), s, acc[r]);
        }
    }
    UNROLLED for (int r = 0; r < n; r++) _mm256_storeu_ps(out + (r0 + r) * TILE + half * 8, acc[r]);
}

__attribute__((target(TILE256_TARGET)))
static void TILE256(const uint8_t *tile, int64_t nb, const int8_t *xq, const float *xs, const int32_t *xo,
                    int rows, float *out, const char *ahead, int64_t ahead_step) {
    for (int half = 0; half < 2; half++)
        for (int r0 = 0; r0 < rows; r0 += 4)
            ROWS4_SWITCH(TILE256_ROWS, rows - r0, tile, nb, xq, xs, xo, half, r0, out, ahead, ahead_step)
}
