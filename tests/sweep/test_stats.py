import math

import numpy as np
import pytest
from scipy import stats

from mmgrpo_jax.sweep.stats import (
    bootstrap_mean,
    interquartile_mean,
    paired_difference,
    performance_profile,
    probability_of_improvement,
    steps_to_threshold,
)


def test_under_three_seeds_the_values_are_shown_and_no_interval():
    """Two seeds at 0 and -0.25 once gave [-0.241, -0.009], an interval "excluding" 0 from a
    tie and one loss; now no interval is claimed from fewer than 3 seeds."""
    got = bootstrap_mean([0.0, -0.25])
    assert got.mean == -0.125 and got.n == 2 and math.isnan(got.low) and math.isnan(got.high)
    assert str(got) == "-0.125 (n=2, no interval)"
    paired = paired_difference({0: 0.5, 1: 0.25}, {0: 0.5, 1: 0.5})
    assert paired.mean == -0.125 and math.isnan(paired.low)


def test_equal_scores_have_a_zero_width_interval_and_one_seed_has_none():
    equal = bootstrap_mean([0.7, 0.7, 0.7])
    assert (equal.mean, equal.low, equal.high) == pytest.approx((0.7, 0.7, 0.7)) and equal.n == 3
    single = bootstrap_mean([0.4])
    assert (
        single.mean == 0.4 and math.isnan(single.low) and str(single) == "0.400 (n=1, no interval)"
    )


@pytest.mark.parametrize("n", [3, 5, 10])
@pytest.mark.parametrize("method", ["BCa", "percentile"])
@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_the_interval_is_scipys_bootstrap(n, method, confidence):
    values = np.random.default_rng(n).normal(0.5, 0.2, size=n)
    got = bootstrap_mean(values, confidence=confidence, resamples=2_000, seed=3, method=method)
    want = stats.bootstrap(
        (values,),
        np.mean,
        n_resamples=2_000,
        confidence_level=confidence,
        method=method,
        rng=np.random.default_rng(3),
    ).confidence_interval
    assert (got.low, got.high) == pytest.approx((want.low, want.high), abs=1e-12)
    assert got.low <= got.mean <= got.high


def test_iqm_and_probability_of_improvement_are_rliables():
    """rliable's definitions (its aggregate_iqm is scipy's 25% trimmed mean; its probability of
    improvement is Mann-Whitney U / (n m) per task), checked on values worked by hand."""
    seeds = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 5.0]  # one far-off seed
    iqm = interquartile_mean(seeds, resamples=2_000)
    assert iqm.mean == pytest.approx((0.3 + 0.4 + 0.5 + 0.6) / 4)  # the middle half
    assert iqm.low <= iqm.mean <= iqm.high < bootstrap_mean(seeds).high
    # pairs (x, y): x beats y in 4 of 9 (1>0, 2>0, 3>0, 3>2), the tie 2 = 2 counts half
    assert probability_of_improvement([1, 2, 3], [0, 2, 4]) == pytest.approx((4 + 0.5) / 9)
    assert probability_of_improvement([1, 1], [0, 0]) == 1.0


def test_the_performance_profile_is_the_fraction_above_each_threshold_with_scipys_band():
    """rliable's score distribution for one task: the fraction of runs above tau (a cell whose
    seeds split into learners and collapses shows a step, not a mean between them)."""
    scores = [0.25, 0.25, 1.0, 1.0, 1.0, 0.75]
    profile = performance_profile(scores, [0.0, 0.5, 0.9, 1.0], resamples=2_000, seed=1)
    assert [p.mean for p in profile] == pytest.approx([1.0, 4 / 6, 3 / 6, 0.0])
    assert (profile[0].low, profile[0].high) == (1.0, 1.0)  # every resample is above 0
    want = stats.bootstrap(
        (np.array(scores),),
        lambda x, axis: np.mean(x > 0.5, axis=axis),
        n_resamples=2_000,
        method="percentile",
        rng=np.random.default_rng(1),
    ).confidence_interval
    assert (profile[1].low, profile[1].high) == pytest.approx((want.low, want.high), abs=1e-12)
    assert math.isnan(performance_profile([0.3, 0.9], [0.5])[0].low)  # 2 runs: no band


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
