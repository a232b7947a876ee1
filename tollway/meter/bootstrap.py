"""A seeded percentile bootstrap for how a statistic differs between two independent samples:
the ratio of its value on the first to its value on the second, with a confidence interval.

Seeded, so a report rerun on the same rows gives the same interval."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

RESAMPLES = 1000
_CHUNK = 100  # resamples drawn at once: bounds memory at 100 x n values per column

# A statistic maps columns, each of shape (resamples, n), to one value per resample.
Statistic = Callable[..., np.ndarray]


def ratio_interval(a: Sequence[np.ndarray], b: Sequence[np.ndarray], statistic: Statistic,
                   resamples: int = RESAMPLES, seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """The `level` interval of statistic(a) / statistic(b), resampling each sample's rows (the
    columns of a sample together). None when the ratio is undefined in too many resamples
    (a zero statistic in b) to say."""
    rng = np.random.default_rng(seed)
    ratios = []
    for start in range(0, resamples, _CHUNK):
        count = min(_CHUNK, resamples - start)
        ia = rng.integers(0, len(a[0]), (count, len(a[0])))
        ib = rng.integers(0, len(b[0]), (count, len(b[0])))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratios.append(statistic(*(c[ia] for c in a)) / statistic(*(c[ib] for c in b)))
    ratios = np.concatenate(ratios)
    finite = ratios[np.isfinite(ratios)]
    if len(finite) < level * resamples:
        return None
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return float(lo), float(hi)
