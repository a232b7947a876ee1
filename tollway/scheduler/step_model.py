"""StepTimeModel: how long a step will take, predicted from what is in it.

A step's time is close to linear in five features, with one coefficient set per kernel
(the int8 GEMV-style kernel and a dense GEMM scale very differently):

  fixed      1 per step: reading every weight once, per-op overhead
  tokens     rows through the linear layers (decode tokens + prefill chunk tokens), rounded
             up to the kernel's row group (ROW_GROUP)
  sampled    rows through the LM head (one per sampling sequence, 1 + k when verifying k drafts;
             the head is 60% of the weights), rounded up the same way
  attention  query-key pairs, in thousands (a decode at context c reads c keys)
  chunks     sequences fed more than one token: each runs its own attention pass, where
             all single-token decodes share one

The starting coefficients come from timing the real runner (model/step_profile.py); after
that every measured step refines them. Fitting is weighted least squares on relative error,
since the fast lane's decisions are about small steps, pulled towards the profile's fit
(ridge) so that a window of similar steps cannot send the unseen features astray.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

FEATURES = ("fixed", "tokens", "sampled", "attention", "chunks")

# Rows go through a kernel's matmuls in groups: torch's int8 weight-only kernel takes 4 rows at
# a time, and fp32 pads to 8 rows for batch invariance (layers.py). The tokens and sampled
# features count the rows the kernel really computes, so the model sees that a 5th row costs a
# whole group and the 6th to 8th are nearly free.
ROW_GROUP = {"int8": 4, "fp32": 8}

HEADROOM_EVERY = 16


def attention_pairs(start_pos: int, num_new: int) -> int:
    """Query-key pairs of num_new tokens at positions start_pos..: each attends to every
    position up to its own."""
    return num_new * start_pos + num_new * (num_new + 1) // 2


class StepShape(NamedTuple):
    """What the model sees of a step. A tuple: the scheduler and the simulator build one per
    sequence considered, millions of times in a large simulation."""

    kernel: str
    tokens: int = 0
    sampled: int = 0
    attention: float = 0.0  # query-key pairs / 1000
    chunks: int = 0  # sequences with more than one new token (prefill chunks, draft checks)

    @classmethod
    def of(cls, plan, seqs=None) -> StepShape:
        """The plan's shape, or that of `seqs` (some of its sequences) alone."""
        tokens = sampled = chunks = pairs = 0
        for s in plan.seqs if seqs is None else seqs:
            n = s.num_new
            tokens, sampled, chunks = tokens + n, sampled + s.num_logit_rows, chunks + (n > 1)
            pairs += attention_pairs(s.start_pos, n)
        return cls(plan.kernel, tokens, sampled, pairs / 1000, chunks)

    def plus(self, start_pos: int, num_new: int, logit_rows: int) -> StepShape:
        """This step with one more sequence: num_new tokens at positions start_pos.., of which
        the last `logit_rows` go through the LM head (1 to sample, 1 + k to verify k drafts)."""
        pairs = attention_pairs(start_pos, num_new)
        return StepShape(self.kernel, self.tokens + num_new, self.sampled + int(logit_rows),
                         self.attention + pairs / 1000, self.chunks + (num_new > 1))

    def with_decodes(self, count: int, pairs: int) -> StepShape:
        """This step with `count` more single-token decodes, reading `pairs` query-key pairs in all."""
        return StepShape(self.kernel, self.tokens + count, self.sampled + count, self.attention + pairs / 1000,
                         self.chunks)

    def features(self) -> tuple[float, ...]:
        group = ROW_GROUP.get(self.kernel, 1)
        return (1.0, float(-(-self.tokens // group) * group), float(-(-self.sampled // group) * group),
                self.attention, float(self.chunks))


@dataclass
class PredictionError:
    """Running error of predictions made before the step's time was known."""

    count: int = 0
    sum_abs: float = 0.0
    sum_rel: float = 0.0

    def add(self, predicted: float, measured: float) -> None:
        self.count += 1
        self.sum_abs += abs(predicted - measured)
        self.sum_rel += abs(predicted - measured) / measured if measured > 0 else 0.0

    @property
    def mean_abs_seconds(self) -> float:
        return self.sum_abs / self.count if self.count else 0.0

    @property
    def mean_rel(self) -> float:
        return self.sum_rel / self.count if self.count else 0.0


class StepTimeModel:
    def __init__(self, coefficients: dict[str, list[float]], window: int = 256, refit_every: int = 16,
                 prior_weight: float = 4.0):
        """coefficients: kernel -> one value per FEATURES entry (seconds per unit)."""
        for kernel, c in coefficients.items():
            if len(c) != len(FEATURES):
                raise ValueError(f"{kernel}: need {len(FEATURES)} coefficients, got {len(c)}")
        self.prior = {k: [float(x) for x in c] for k, c in coefficients.items()}
        self.coefficients = {k: list(c) for k, c in self.prior.items()}
        # Whether time never falls as work is added (fitted coefficients are; a prior may not be)
        self.monotone = all(x >= 0 for c in self.coefficients.values() for x in c)
        self.prior_weight = prior_weight
        self.refit_every = refit_every
        self._window: dict[str, deque[tuple[tuple[float, ...], float]]] = {
            k: deque(maxlen=window) for k in coefficients}
        self._base: dict[str, list[tuple[tuple[float, ...], float]]] = {k: [] for k in coefficients}
        # The base rows' normal equations, summed once: a refit adds the window's (numpy).
        self._base_sums: dict[str, _Sums] = {k: _Sums.of([]) for k in coefficients}
        self._since_refit = 0
        # (predicted, measured / predicted) of the latest steps, per kernel
        self._overruns: dict[str, deque[tuple[float, float]]] = {k: deque(maxlen=window) for k in coefficients}
        self._headroom: dict[tuple, float] = {}  # headroom() answers, until HEADROOM_EVERY more steps
        self._observed = 0
        self.error = PredictionError()
        self.error_by_kernel: dict[str, PredictionError] = {k: PredictionError() for k in coefficients}

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], **options) -> StepTimeModel:
        """A model from measured (shape, seconds) pairs, e.g. a profile of the runner."""
        by_kernel: dict[str, list[tuple[tuple[float, ...], float]]] = {}
        for shape, seconds in samples:
            if _valid(seconds):
                by_kernel.setdefault(shape.kernel, []).append((shape.features(), seconds))
        if not by_kernel:
            raise ValueError("no samples to fit a step model to")
        fitted = {k: _robust_solve(rows) for k, rows in by_kernel.items()}
        model = cls(fitted, **options)
        # Refits keep the profile in the data: it spans every feature, where recent steps may
        # all look alike and leave some directions unconstrained.
        model._base = {k: [row for row in rows if _relative_residual(fitted[k], row) <= 1.0]
                       for k, rows in by_kernel.items()}
        model._base_sums = {k: _Sums.of(rows) for k, rows in model._base.items()}
        return model

    def predict(self, shape: StepShape, kernel: str | None = None) -> float:
        """Seconds for a step of this shape, run with `kernel` (default: the shape's)."""
        kernel = kernel or shape.kernel
        c = self.coefficients.get(kernel)
        if c is None:
            raise ValueError(f"the step model knows kernels {sorted(self.coefficients)}, not {kernel!r}")
        group = ROW_GROUP.get(kernel, 1)  # features(), written out: this runs per sequence considered
        return (c[0] + c[1] * (-(-shape.tokens // group) * group) + c[2] * (-(-shape.sampled // group) * group)
                + c[3] * shape.attention + c[4] * shape.chunks)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """A step of this shape took `seconds`: score the prediction, then learn from it."""
        if shape.kernel not in self.coefficients or not _valid(seconds):
            return
        predicted = self.predict(shape)
        self.error.add(predicted, seconds)
        if predicted > 0:
            self._overruns[shape.kernel].append((predicted, seconds / predicted))
        self.error_by_kernel[shape.kernel].add(predicted, seconds)
        self._window[shape.kernel].append((shape.features(), seconds))
        self._observed += 1
        if self._observed % HEADROOM_EVERY == 0:
            self._headroom.clear()
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self.refit()

    def headroom(self, kernel: str, quantile: float, near: float | None = None, min_steps: int = 20) -> float:
        """How much longer than predicted a step with this kernel runs, at this quantile of
        recent steps (>= 1); of steps predicted near `near` (0.5x to 1.5x) when there are enough, since
        small and large steps miss by different amounts. Planning to target / headroom meets
        the target in about that fraction of steps.

        Worked out afresh every HEADROOM_EVERY steps, not every step: a quantile of the last
        few hundred steps barely moves in a few more, and sorting them is a scheduler's largest
        cost per step."""
        key = (kernel, quantile, near, min_steps)
        if key not in self._headroom:
            self._headroom[key] = self._overrun_quantile(kernel, quantile, near, min_steps)
        return self._headroom[key]

    def _overrun_quantile(self, kernel: str, quantile: float, near: float | None, min_steps: int) -> float:
        overruns = self._overruns.get(kernel, ())
        ratios = [r for p, r in overruns if near is None or near / 2 <= p <= near * 1.5]
        if len(ratios) < min_steps:
            ratios = [r for _, r in overruns]
        if len(ratios) < min_steps:
            return 1.0
        ordered = sorted(ratios)
        return max(1.0, ordered[min(len(ordered) - 1, int(quantile * len(ordered)))])

    def refit(self) -> None:
        self._since_refit = 0
        for kernel, rows in self._window.items():
            if rows:
                sums = self._base_sums[kernel] + _Sums.of(rows)
                self.coefficients[kernel] = _solve(sums, self.prior[kernel], self.prior_weight)
        self.monotone = all(x >= 0 for c in self.coefficients.values() for x in c)

    def to_dict(self) -> dict:
        return {"features": list(FEATURES), "coefficients": {k: list(c) for k, c in self.coefficients.items()},
                "error": {"steps": self.error.count, "mean_abs_seconds": self.error.mean_abs_seconds,
                          "mean_rel": self.error.mean_rel}}


def _robust_solve(rows: list[tuple[tuple[float, ...], float]]) -> list[float]:
    """Fit, then refit without samples far off the fit: a profile step that ran while something
    else had the CPU can take several times its usual time."""
    c = _solve(_Sums.of(rows), prior=None, prior_weight=0.0)
    residuals = [_relative_residual(c, row) for row in rows]
    cut = max(0.25, 4 * sorted(residuals)[len(residuals) // 2])
    kept = [row for row, r in zip(rows, residuals) if r <= cut]
    return _solve(_Sums.of(kept), prior=None, prior_weight=0.0) if len(kept) < len(rows) else c


def _relative_residual(c: list[float], row: tuple[tuple[float, ...], float]) -> float:
    features, seconds = row
    return abs(sum(w * x for w, x in zip(c, features)) / seconds - 1)


def _valid(seconds: float) -> bool:
    return math.isfinite(seconds) and seconds > 0


class _Sums(NamedTuple):
    """Weighted least squares on relative error, as sums over rows (x, y): A = sum w x x^T,
    b = sum w x y with w = 1/y^2, and sum |x_j / y| (each feature's typical size, for the
    ridge's units), over `count` rows."""

    a: np.ndarray
    b: np.ndarray
    scale: np.ndarray
    count: int

    @classmethod
    def of(cls, rows) -> _Sums:
        # Elementwise products summed over axis 0, never BLAS's `@`: BLAS orders its sums by the
        # CPU's vector width, so a fit (and every simulated run) would differ in the last bits
        # between an AVX2 and an AVX-512 machine. Here each sum runs row by row on any CPU.
        n = len(FEATURES)
        x = np.array([row[0] for row in rows], dtype=float).reshape(-1, n)
        y = np.array([row[1] for row in rows], dtype=float)
        wx = x * np.where(y > 0, 1.0 / np.where(y > 0, y * y, 1.0), 1.0)[:, None]
        return cls((wx[:, :, None] * x[:, None, :]).sum(axis=0), (wx * y[:, None]).sum(axis=0),
                   (np.abs(x) / np.maximum(y, 1e-9)[:, None]).sum(axis=0), len(rows))

    def __add__(self, other: _Sums) -> _Sums:
        return _Sums(self.a + other.a, self.b + other.b, self.scale + other.scale, self.count + other.count)


def _solve(sums: _Sums, prior: list[float] | None, prior_weight: float) -> list[float]:
    """Non-negative weighted least squares with relative weights (1/y^2), plus a ridge pull
    towards `prior` scaled to each feature's typical size. Features whose coefficient would go
    negative are dropped and the rest refit: no step gets cheaper by adding work to it."""
    n = len(FEATURES)
    active = [True] * n
    while True:
        solution = _normal_equations(sums, prior, prior_weight, active)
        negative = [j for j in range(n) if active[j] and solution[j] < 0]
        if not negative:
            return solution
        for j in negative:
            active[j] = False


def _normal_equations(sums: _Sums, prior, prior_weight, active) -> list[float]:
    a, b = sums.a.copy(), sums.b.copy()
    scale = sums.scale / sums.count if sums.count else np.zeros_like(sums.scale)  # mean |x_i / y|
    if prior is not None:
        lam = prior_weight * np.maximum(scale, 1e-6) ** 2
        b += lam * np.asarray(prior, dtype=float)
    else:
        diagonal = np.diag(a)
        lam = 1e-9 * np.where(diagonal != 0, diagonal, 1.0)
    a += np.diag(lam)
    pinned = ~np.asarray(active)  # to zero
    a[pinned, :] = 0.0
    a[:, pinned] = 0.0
    a[pinned, pinned] = 1.0
    b[pinned] = 0.0
    return _gauss_solve(a.tolist(), b.tolist())


def _gauss_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b by Gaussian elimination with partial pivoting, in Python floats: LAPACK's solve
    too rounds differently by CPU. A column with no pivot left (a feature never seen, and no
    prior) gets coefficient 0."""
    n = len(b)
    rows = [list(r) + [v] for r, v in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if rows[pivot][col] == 0.0:
            continue
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            f = rows[r][col] / rows[col][col]
            if f:
                rows[r] = [u - f * v for u, v in zip(rows[r], rows[col])]
    x = [0.0] * n
    for col in reversed(range(n)):
        if rows[col][col] != 0.0:
            x[col] = (rows[col][n] - sum(rows[col][j] * x[j] for j in range(col + 1, n))) / rows[col][col]
    return x
