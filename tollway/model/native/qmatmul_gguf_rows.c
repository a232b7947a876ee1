/* Rows of a GGUF tensor as float32, read from the file's blocks where they lie (the memory map): the
embedding's rows of a step's tokens, without a float copy of the table. Every value is what GGUF's dequantization gives, in float32 (d * q, with d * sc
formed first where the format has sub-block scales, as gguf-py and ggml do). */
#include "qmatmul_kmin.h"  /* Q4_K's and Q5_K's 6-bit scales */

enum gguf_type { GGUF_F32 = 0, GGUF_F16 = 1, GGUF_Q4_0 = 2, GGUF_Q5_0 = 6, GGUF_Q8_0 = 8, GGUF_Q4_K = 12,
                 GGUF_Q5_K = 13, GGUF_Q6_K = 14, GGUF_BF16 = 30 };

static float gguf_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

/* One row of k values (`src`, the file's bytes) into out. Returns -1 for a type it does not read. */
static int gguf_row(int type, const uint8_t *src, int64_t k, float *out) {
    switch (type) {
        case GGUF_F32:
            memcpy(out, src, (size_t)k * sizeof(float));
            return 0;
        case GGUF_F16:
            for (int64_t i = 0; i < k; i++) out[i] = gguf_half(src + 2 * i);
            return 0;
        case GGUF_BF16:
            for (int64_t i = 0; i < k; i++) {
                uint32_t bits = (uint32_t)(src[2 * i] | src[2 * i + 1] << 8) << 16;
                memcpy(out + i, &bits, 4);
            }
            return 0;
        case GGUF_Q8_0:  /* d, 32 int8 */
            for (int64_t b = 0; b < k / 32; b++, src += 34, out += 32) {
                float d = gguf_half(src);
                for (int i = 0; i < 32; i++) out[i] = d * (float)(int8_t)src[2 + i];
            }
            return 0;
        case GGUF_Q4_0:  /* d, 16 bytes: value j low nibble, j + 16 high; w = d * (q - 8) */
            for (int64_t b = 0; b < k / 32; b++, src += 18, out += 32) {
                float d = gguf_half(src);
                for (int i = 0; i < 16; i++) {
                    out[i] = d * (float)((src[2 + i] & 15) - 8);
                    out[i + 16] = d * (float)((src[2 + i] >> 4) - 8);
                }
            }
            return 0;
        case GGUF_Q5_0:  /* d, 32 fifth bits, 16 bytes of nibbles; w = d * (q - 16) */
            for (int64_t b = 0; b < k / 32; b++, src += 22, out += 32) {
                float d = gguf_half(src);
                uint32_t fifth;
                memcpy(&fifth, src + 2, 4);
                for (int i = 0; i < 16; i++) {
                    int lo = (src[6 + i] & 15) | (int)((fifth >> i) & 1) << 4;
                    int hi = (src[6 + i] >> 4) | (int)((fifth >> (i + 16)) & 1) << 4;
                    out[i] = d * (float)(lo - 16);
                    out[i + 16] = d * (float)(hi - 16);
                }
            }
            return 0;
        case GGUF_Q4_K:  /* d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles */
            for (int64_t s = 0; s < k / 256; s++, src += 144, out += 256) {
                float d = gguf_half(src), dmin = gguf_half(src + 2);
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    q4_k_scale_min(src + 4, j, &sc, &m);
                    float scale = d * (float)sc, min = dmin * (float)m;
                    const uint8_t *nibbles = src + 16 + j / 2 * 32;
                    for (int i = 0; i < 32; i++) out[j * 32 + i] = scale * (float)((nibbles[i] >> (4 * (j % 2))) & 15) - min;
                }
            }
            return 0;
        case GGUF_Q5_K:  /* d, dmin, 12 bytes of 6-bit scales and mins, 32 bytes of fifth bits, 128 of nibbles */
            for (int64_t s = 0; s < k / 256; s++, src += 176, out += 256) {
                float d = gguf_half(src), dmin = gguf_half(src + 2);
                const uint8_t *qh = src + 16;
                for (int j = 0; j < 8; j++) {
                    uint8_t sc, m;
                    q4_k_scale_min(src + 4, j, &sc, &m);
                    float scale = d * (float)sc, min = dmin * (float)m;
                    const uint8_t *nibbles = src + 48 + j / 2 * 32;
                    for (int i = 0; i < 32; i++) {
                        int q = ((nibbles[i] >> (4 * (j % 2))) & 15) | ((qh[i] >> j) & 1) << 4;
                        out[j * 32 + i] = scale * (float)q - min;
                    }
                }
            }
            return 0;
        case GGUF_Q6_K:  /* 128 bytes low nibbles, 64 bytes high bit pairs, 16 int8 scales, d */
            for (int64_t s = 0; s < k / 256; s++, src += 210, out += 256) {
                const uint8_t *ql = src, *qh = src + 128;
                const int8_t *sc = (const int8_t *)(src + 192);
                float d = gguf_half(src + 208);
                for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8) {
                    float *o = out + half * 128;
                    for (int l = 0; l < 32; l++) {
                        int q1 = ((ql[l] & 15) | ((qh[l] >> 0) & 3) << 4) - 32;
                        int q2 = ((ql[l + 32] & 15) | ((qh[l] >> 2) & 3) << 4) - 32;
                        int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
                        int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
                        int is = l / 16;
                        o[l] = d * (float)sc[is] * (float)q1;
                        o[l + 32] = d * (float)sc[is + 2] * (float)q2;
                        o[l + 64] = d * (float)sc[is + 4] * (float)q3;
                        o[l + 96] = d * (float)sc[is + 6] * (float)q4;
                    }
                }
            }
            return 0;
    }
    return -1;
}

/* Whether gguf_rows reads `type`. */
int gguf_rows_supported(int type) {
    float probe[256];
    static const uint8_t zeros[256 * 4];
    return gguf_row(type, zeros, 256, probe) == 0;
}

/* out[i, :k] (row stride ldo) = row ids[i] of a table whose rows are row_bytes apart, times
   *scale where scale is not NULL (Gemma's embedding scale). Returns -1 for a type it does not read. */
int gguf_rows(int type, const uint8_t *table, int64_t row_bytes, int64_t k, const int64_t *ids, int64_t n,
              const float *scale, float *out, int64_t ldo) {
    for (int64_t i = 0; i < n; i++) {
        float *o = out + i * ldo;
        if (gguf_row(type, table + ids[i] * row_bytes, k, o)) return -1;
        if (scale)
            for (int64_t j = 0; j < k; j++) o[j] *= *scale;
    }
    return 0;
}
