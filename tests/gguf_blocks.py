"""Random valid blocks of the GGUF types the native kernels read, as a file holds them: for the
kernels' tests and for the small models the tests write as GGUF files."""
from __future__ import annotations

import numpy as np

# Per type: values and bytes of a block, and where its fp16 scales lie in it (Q4_K, Q5_K: d, then dmin).
LAYOUTS = {"Q8_0": (32, 34, (0,)), "Q5_0": (32, 22, (0,)), "Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)),
           "Q5_K": (256, 176, (0, 2)), "Q4_0": (32, 18, (0,))}
# The types whose d and dmin their quantizer makes positive: w = d * sc * q - dmin * m.
POSITIVE_SCALES = ("Q4_K", "Q5_K")


def random_blocks(gguf_type: str, n: int, k: int, seed: int = 0, zero_row: bool = True,
                  scales: tuple[float, float] = (1e-4, 3e-2)) -> np.ndarray:
    """n rows of random valid blocks of `gguf_type` as a file holds them, [n, row bytes]: random value
    and scale bytes, fp16 scales between `scales` (Q8_0, Q5_0, Q4_0, Q6_K of either sign; Q4_K's and
    Q5_K's d and dmin positive, as their quantizer makes them), and (zero_row, n > 2) row n // 2 all
    zero scales."""
    values, size, scale_at = LAYOUTS[gguf_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    low, high = np.log10(scales[0]), np.log10(scales[1])
    for at in scale_at:
        d = 10 ** rng.uniform(low, high, (n, k // values))
        if gguf_type not in POSITIVE_SCALES:
            d *= rng.choice([-1, 1], d.shape)
        if zero_row and n > 2:
            d[n // 2] = 0
        blocks[:, :, at:at + 2] = d.astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return blocks.reshape(n, -1)
