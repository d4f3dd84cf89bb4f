"""Intervals over seeds: how sure a sweep's cell means and differences are.

A cell's runs differ only by seed, so its uncertainty is the spread over seeds: the percentile
bootstrap of the mean resamples seeds with replacement. Two cells run on the same seeds are
compared seed by seed (paired), which removes what the seed does to both. With few seeds the
bootstrap distribution is computed exactly (every resample enumerated, as many as n**n), beyond
that from `resamples` random draws of a seeded generator, so a table is reproducible.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

EXACT_LIMIT = 50_000  # enumerate every resample while n**n stays below this (n <= 6)


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over `n` seeds and its bootstrap interval; low / high are NaN for one seed."""

    mean: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:.3f} (n={self.n})"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _checked(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty list of numbers, got {values!r}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}] is {array[bad[0]]}: every run needs a finite score")
    return array


def _resampled_means(values: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    n = values.size
    if n**n <= EXACT_LIMIT:
        indices = np.array(list(itertools.product(range(n), repeat=n)))
    else:
        indices = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    return values[indices].mean(axis=1)


def bootstrap_mean(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Interval:
    """The mean of `values` (one per seed) with its percentile-bootstrap interval."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    array = _checked(values, "values")
    mean = float(array.mean())
    if array.size == 1:
        return Interval(mean, math.nan, math.nan, 1)
    means = _resampled_means(array, resamples, seed)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(mean, float(low), float(high), int(array.size))


def paired_difference(
    scores: Mapping[int, float],
    baseline: Mapping[int, float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> Interval:
    """Mean of (score - baseline) over the seeds both ran, seed by seed, with its interval.
    The cells must share their seeds: an unpaired seed is an error, not dropped."""
    if set(scores) != set(baseline):
        only = sorted(set(scores) ^ set(baseline))
        raise ValueError(f"paired cells must run the same seeds; unpaired seeds: {only}")
    seeds = sorted(scores)
    differences = [scores[s] - baseline[s] for s in seeds]
    return bootstrap_mean(differences, confidence=confidence, resamples=resamples, seed=seed)


def steps_to_threshold(curve: Sequence[tuple[float, float]], threshold: float) -> float | None:
    """The first step at which the curve (step, score) reaches `threshold`; None if never."""
    for step, score in sorted(curve):
        if score >= threshold:
            return step
    return None
