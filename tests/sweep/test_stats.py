import itertools
import math

import numpy as np
import pytest

from mmgrpo_jax.sweep.stats import (
    bootstrap_mean,
    paired_difference,
    steps_to_threshold,
)


def test_two_seeds_by_hand():
    # resamples of (0, 1): (0,0) (0,1) (1,0) (1,1) -> means 0, .5, .5, 1; the 2.5% and 97.5%
    # quantiles (linear interpolation over the 4 sorted means) are 0 + 3 * .025 * .5 and its mirror
    got = bootstrap_mean([0.0, 1.0])
    assert got.mean == 0.5 and got.n == 2
    assert got.low == pytest.approx(0.0375) and got.high == pytest.approx(0.9625)


def test_equal_scores_have_a_zero_width_interval_and_one_seed_has_none():
    equal = bootstrap_mean([0.7, 0.7, 0.7])
    assert (equal.mean, equal.low, equal.high) == pytest.approx((0.7, 0.7, 0.7)) and equal.n == 3
    single = bootstrap_mean([0.4])
    assert single.mean == 0.4 and math.isnan(single.low) and str(single) == "0.400 (n=1)"


def numpy_restatement(values, confidence, resamples, seed):
    """The same interval written out plainly: every resample a loop, quantiles by hand."""
    values = list(values)
    n = len(values)
    if n**n <= 50_000:
        draws = list(itertools.product(range(n), repeat=n))
    else:
        rng = np.random.default_rng(seed)
        draws = [tuple(row) for row in rng.integers(0, n, size=(resamples, n))]
    means = sorted(sum(values[i] for i in draw) / n for draw in draws)

    def quantile(q):  # numpy's default "linear" method
        position = q * (len(means) - 1)
        below = math.floor(position)
        above = min(below + 1, len(means) - 1)
        return means[below] + (position - below) * (means[above] - means[below])

    tail = (1 - confidence) / 2
    return quantile(tail), quantile(1 - tail)


@pytest.mark.parametrize("n", [3, 5, 10])
@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_the_interval_equals_a_plain_restatement(n, confidence):
    values = np.random.default_rng(n).normal(0.5, 0.2, size=n)
    got = bootstrap_mean(values, confidence=confidence, resamples=2_000, seed=3)
    low, high = numpy_restatement(values, confidence, 2_000, 3)
    assert got.low == pytest.approx(low, abs=1e-12) and got.high == pytest.approx(high, abs=1e-12)
    assert got.low <= got.mean <= got.high


def test_paired_differences_remove_what_the_seed_does_to_both():
    seed_effect = {s: 0.1 * s for s in range(8)}
    baseline = {s: 0.2 + seed_effect[s] for s in seed_effect}
    better = {s: 0.25 + seed_effect[s] for s in seed_effect}  # always 0.05 better
    paired = paired_difference(better, baseline)
    assert paired.mean == pytest.approx(0.05)
    assert paired.high - paired.low == pytest.approx(0.0, abs=1e-12)
    unpaired_low = bootstrap_mean(list(better.values())).low
    unpaired_high = bootstrap_mean(list(baseline.values())).high
    assert unpaired_low < unpaired_high  # unpaired, the two cells' intervals overlap


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: bootstrap_mean([]), "non-empty list"),
        (lambda: bootstrap_mean([0.1, float("nan")]), r"values\[1\] is nan"),
        (lambda: bootstrap_mean([0.1], confidence=1.0), "confidence must be in"),
        (
            lambda: paired_difference({0: 1.0, 1: 1.0}, {0: 1.0, 2: 1.0}),
            r"unpaired seeds: \[1, 2\]",
        ),
    ],
)
def test_bad_inputs_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_steps_to_threshold():
    curve = [(20, 0.9), (0, 0.0), (10, 0.5)]
    assert steps_to_threshold(curve, 0.5) == 10
    assert steps_to_threshold(curve, 0.95) is None
