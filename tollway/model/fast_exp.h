/* Shared by the native sources (row_ops.c, sampling.c), each compiled for this machine. */
#ifndef TOLLWAY_FAST_EXP_H
#define TOLLWAY_FAST_EXP_H

#include <stdint.h>

/* e^z for z in [-87, 88], to about 2 ulp: z = n ln2 + r with |r| <= ln2 / 2, e^r by its
   Taylor series, 2^n built in the exponent bits. Branch-free plain arithmetic, so loops over
   it vectorize. */
static inline float exp_poly(float z) {
    z = z < -87.0f ? -87.0f : z;
    z = z > 88.0f ? 88.0f : z;
    float t = z * 1.44269504088896341f;
    float n = (t + 12582912.0f) - 12582912.0f;  /* t rounded to an integer: 1.5 * 2^23 shifts the fraction out */
    float r = z - n * 0.693145751953125f - n * 1.42860682030941723e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

#endif
