/* The row-wise operations between a decoder layer's matmuls, for the CPU.

   At batch 1 each of these is a few hundred floats, and torch spends more time dispatching
   its five-odd ops per norm than computing them. One call here does the whole operation.
   Every output row depends only on its own input row and is computed in a fixed order, so a
   row's bits never depend on what else shares the step. */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* 1 / rms(x) over n floats, accumulated in double: a fixed order, and exact enough that the
   order does not matter to the float result in practice. */
static float inv_rms(const float *x, int64_t n, float eps) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++)
        sum += (double)x[i] * x[i];
    return 1.0f / sqrtf((float)(sum / (double)n) + eps);
}

/* out[t] = x[t] / rms(x[t]) * w (w may be NULL). x rows are `stride` floats apart. */
void rms_norm(const float *x, int64_t stride, const float *w, float eps, int64_t rows, int64_t n, float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * stride;
        float *o = out + t * n;
        float r = inv_rms(xr, n, eps);
        if (w)
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r * w[i];
        else
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r;
    }
}

/* The residual update and the norm that follows it, in one pass per row:
   x[t] += h_w ? rms_norm(h[t]) * h_w : h[t]   (in place)
   normed[t] = rms_norm(x[t]) * w              (skipped when normed is NULL) */
void add_rms_norm(float *x, const float *h, const float *h_w, const float *w, float eps, int64_t rows, int64_t n,
                  float *normed) {
    for (int64_t t = 0; t < rows; t++) {
        float *xr = x + t * n;
        const float *hr = h + t * n;
        if (h_w) {
            float r = inv_rms(hr, n, eps);
            for (int64_t i = 0; i < n; i++) xr[i] += hr[i] * r * h_w[i];
        } else {
            for (int64_t i = 0; i < n; i++) xr[i] += hr[i];
        }
        if (normed) {
            float r = inv_rms(xr, n, eps);
            float *o = normed + t * n;
            for (int64_t i = 0; i < n; i++) o[i] = xr[i] * r * w[i];
        }
    }
}

/* Per-head RMS norm (w: [heads * d], or NULL for none) then rotate-half RoPE, for the q and k
   heads at the start of each qkv row. cos and signed_sin are [positions, d] tables (signed_sin
   carries the sign of rotate_half); out is [rows, heads, d]. */
void qk_norm_rope(const float *qkv, int64_t stride, int64_t rows, int64_t heads, int64_t d, const float *w, float eps,
                  const float *cos, const float *signed_sin, const int64_t *positions, float *out) {
    int64_t half = d / 2;
    float buf[d];
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * d;
        const float *s = signed_sin + positions[t] * d;
        for (int64_t j = 0; j < heads; j++) {
            const float *xr = qkv + t * stride + j * d;
            float *o = out + (t * heads + j) * d;
            if (w) {
                float r = inv_rms(xr, d, eps);
                const float *wj = w + j * d;
                for (int64_t i = 0; i < d; i++) buf[i] = xr[i] * r * wj[i];
            } else {
                memcpy(buf, xr, d * sizeof(float));
            }
            for (int64_t i = 0; i < half; i++) {
                o[i] = buf[i] * c[i] + buf[i + half] * s[i];
                o[i + half] = buf[i + half] * c[i + half] + buf[i] * s[i + half];
            }
        }
    }
}

/* e^z for z in [-87, 88], to about 2 ulp: z = n ln2 + r with |r| <= ln2 / 2, e^r by its
   Taylor series, 2^n built in the exponent bits. Plain arithmetic, so the loop vectorizes. */
static inline float exp_poly(float z) {
    z = z < -87.0f ? -87.0f : (z > 88.0f ? 88.0f : z);
    float t = z * 1.44269504088896341f;
    int32_t n = (int32_t)(t + (t >= 0.0f ? 0.5f : -0.5f));
    float r = z - (float)n * 0.693145751953125f - (float)n * 1.42860682030941723e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits = (n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* out[t] = act(gate[t]) * up[t], with gate_up rows [gate (width) | up (width)].
   kind 0: GELU, tanh form, written as x * sigmoid(2u) (the same function: 1 + tanh u = 2 sigmoid 2u).
   kind 1: SiLU, x * sigmoid(x). */
void gated_act(const float *gate_up, int64_t rows, int64_t width, int32_t kind, float *out) {
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gate_up + t * 2 * width;
        const float *u = g + width;
        float *o = out + t * width;
        if (kind == 0) {
            for (int64_t i = 0; i < width; i++) {
                float x = g[i];
                float inner = 1.5957691216057308f * (x + 0.044715f * x * x * x);  /* 2 sqrt(2/pi) (...) */
                o[i] = x / (1.0f + exp_poly(-inner)) * u[i];
            }
        } else {
            for (int64_t i = 0; i < width; i++) {
                float x = g[i];
                o[i] = x / (1.0f + exp_poly(-x)) * u[i];
            }
        }
    }
}
