"""Intervals over seeds: how sure a sweep's cell means and differences are.

A cell's runs differ only by seed, so its uncertainty is the spread over seeds. Intervals come
from `scipy.stats.bootstrap` (BCa by default: it corrects the percentile interval's bias and
skew, which matter at the handful of seeds a sweep has) with a seeded generator, so a table is
reproducible. Two cells run on the same seeds are compared seed by seed (paired): the interval
of the mean difference, which removes what the seed does to both. Under MIN_SEEDS seeds no
interval is given: a bootstrap over 2 seeds can only restate them (2 seeds at 0 and -0.25 gave
[-0.241, -0.009], "excluding" 0), so the values are shown and the reason said (Agarwal et al.
2021, "Deep RL at the edge of the statistical precipice"). The interquartile mean and the
probability of improvement are the same statistics as that paper's `rliable` library
(`scipy.stats.trim_mean` at 25%, the Mann-Whitney U over n x m pairs), with its percentile
bootstrap, and so is the performance profile (the fraction of runs above each threshold).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from scipy import stats

MIN_SEEDS = 3  # fewer: values, no interval
METHODS = ("BCa", "percentile", "basic")


@dataclasses.dataclass(frozen=True)
class Interval:
    """A statistic over `n` seeds and its bootstrap interval; low / high are NaN under
    MIN_SEEDS seeds (no interval is claimed)."""

    mean: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if math.isnan(self.low):
            return f"{self.mean:.3f} (n={self.n}, no interval)"
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def _checked(values: Sequence[float], what: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{what} must be a non-empty list of numbers, got {values!r}")
    bad = np.flatnonzero(~np.isfinite(array))
    if bad.size:
        raise ValueError(f"{what}[{bad[0]}] is {array[bad[0]]}: every run needs a finite score")
    return array


def _interval(
    array: np.ndarray,
    statistic: Callable[..., np.ndarray],
    *,
    confidence: float,
    resamples: int,
    seed: int,
    method: str,
) -> Interval:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    value = float(statistic(array))
    if array.size < MIN_SEEDS:
        return Interval(value, math.nan, math.nan, int(array.size))
    if np.all(array == array[0]):  # every resample is the same: a point, not BCa's 0 / 0
        return Interval(value, value, value, int(array.size))
    result = stats.bootstrap(
        (array,),
        statistic,
        n_resamples=resamples,
        confidence_level=confidence,
        method=method,
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return Interval(value, float(low), float(high), int(array.size))


def _mean(x: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis)


def _iqm(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """The interquartile mean, as rliable's `aggregate_iqm`: the mean of the middle 50%."""
    return stats.trim_mean(x, proportiontocut=0.25, axis=axis)


def bootstrap_mean(
    values: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
    method: str = "BCa",
) -> Interval:
    """The mean of `values` (one per seed) with its bootstrap interval (scipy, BCa)."""
    array = _checked(values, "values")
    return _interval(
        array, _mean, confidence=confidence, resamples=resamples, seed=seed, method=method
    )


def interquartile_mean(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Interval:
    """rliable's interquartile mean with its percentile-bootstrap interval: robust to one
    seed far from the others (a collapse), unlike the mean, and less noisy than the median."""
    array = _checked(values, "values")
    return _interval(
        array, _iqm, confidence=confidence, resamples=resamples, seed=seed, method="percentile"
    )


def performance_profile(
    values: Sequence[float],
    thresholds: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 2_000,
    seed: int = 0,
) -> list[Interval]:
    """rliable's performance profile (score distribution) of one cell: for each threshold tau,
    the fraction of runs that scored above tau, with a percentile-bootstrap band over runs (a
    stratified bootstrap over one task is the plain bootstrap of its runs). Unlike a mean it
    shows a cell whose seeds split into learners and collapses as such."""
    array = _checked(values, "values")
    profile = []
    for tau in thresholds:

        def above(x: np.ndarray, axis: int = -1, tau: float = float(tau)) -> np.ndarray:
            return np.mean(x > tau, axis=axis)

        profile.append(
            _interval(
                array,
                above,
                confidence=confidence,
                resamples=resamples,
                seed=seed,
                method="percentile",
            )
        )
    return profile


def probability_of_improvement(scores: Sequence[float], baseline: Sequence[float]) -> float:
    """P(a run of `scores` beats a run of `baseline`), ties counting half: rliable's
    `probability_of_improvement` for one task (Mann-Whitney U over the n x m pairs)."""
    x, y = _checked(scores, "scores"), _checked(baseline, "baseline")
    return float(stats.mannwhitneyu(x, y).statistic / (x.size * y.size))


def paired_difference(
    scores: Mapping[int, float],
    baseline: Mapping[int, float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> Interval:
    """Mean of (score - baseline) over the seeds both ran, seed by seed, with its BCa interval
    (the paired statistic: resampling seeds, each with both its scores). The cells must share
    their seeds: an unpaired seed is an error, not dropped."""
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
