import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmgrpo_jax.rl.losses import (
    AGGREGATIONS,
    VARIANTS,
    LossConfig,
    LossRows,
    TokenTerms,
    policy_loss,
    register_aggregation,
    register_loss,
)

jax.config.update("jax_enable_x64", False)
B, T, L = 6, 7, 10  # rows, completion positions, dr_grpo's max_completion_length
CLIPPED = ("grpo", "bnpo", "dapo", "dr_grpo")


def config(variant, **kwargs):
    defaults = {"cispo": {"epsilon_high": 5.0}, "dr_grpo": {"max_completion_length": L}}
    return LossConfig(variant, **{**defaults.get(variant, {}), **kwargs})


# ---------------------------------------------------------------- numpy restatement (float64)


def reference(cfg, logps, old, adv, mask, ref=None, tids=None, num_sequences=None, sampler=None):
    """docs/design.md#losses (TRL 1.16's _compute_loss) token by token, with explicit loops; masked
    entries are never read."""
    e, eh = cfg.epsilon, cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
    if tids is not None:
        mask = mask & (np.asarray(tids) >= 0)[:, None]  # a padding row counts nowhere
    rows, cols = mask.shape
    per = np.zeros((rows, cols))
    ratios, low, high, kls, dropped, is_weights = [], [], [], [], [], []
    for i in range(rows):
        n_i = int(mask[i].sum())
        seq = sum(logps[i, t] - old[i, t] for t in range(cols) if mask[i, t])
        s = math.exp(seq / max(n_i, 1))
        # vespo: log w is the clamped *sum* of the clamped token log-ratios
        clamped = sum(min(max(logps[i, t] - old[i, t], -20), 20) for t in range(cols) if mask[i, t])
        log_w = min(max(clamped, math.log(1e-8)), 20.0)
        behaviour = old if sampler is None else sampler
        # TRL's sampler-mismatch weight: exp(l_old - l_sampler) per token, or of the row's sum
        diffs = [old[i, t] - behaviour[i, t] if mask[i, t] else 0.0 for t in range(cols)]
        mode = cfg.sampler_correction or ""
        if mode.startswith("sequence"):
            diffs = [sum(diffs)] * cols
        weights = [math.exp(d) for d in diffs]
        w_low = cfg.sampler_correction_min or 0.0
        w_high = cfg.sampler_correction_max if cfg.sampler_correction_max is not None else math.inf
        if mode.endswith("truncate"):
            weights = [min(max(w, w_low), w_high) for w in weights]
        elif mode.endswith("mask"):
            weights = [w if w_low <= w <= w_high else 0.0 for w in weights]
        else:
            weights = [1.0] * cols  # no correction
        keep = True
        if cfg.off_policy_mask_threshold is not None:  # TRL's get_off_policy_mask
            gaps = [behaviour[i, t] - logps[i, t] for t in range(cols) if mask[i, t]]
            gaps = [g if math.isfinite(g) else 0.0 for g in gaps]
            keep = adv[i] >= 0 or sum(gaps) / max(n_i, 1) <= cfg.off_policy_mask_threshold
        for t in range(cols):
            if not mask[i, t]:
                continue
            a, lp = adv[i], logps[i, t]
            rho = math.exp(lp - old[i, t])
            if cfg.variant in CLIPPED:
                first = rho if cfg.delta is None else min(rho, cfg.delta)
                val = -min(first * a, min(max(rho, 1 - e), 1 + eh) * a)
                low.append(rho < 1 - e and a < 0)
                high.append(rho > 1 + eh and a > 0)
            elif cfg.variant in ("gspo", "luspo"):
                rho = s
                first = s if cfg.delta is None else min(s, cfg.delta)
                val = -min(first * a, min(max(s, 1 - e), 1 + eh) * a)
                low.append(s < 1 - e and a < 0)
                high.append(s > 1 + eh and a > 0)
            elif cfg.variant == "sapo":
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                val = -(4 / tau) * a / (1 + math.exp(-tau * (rho - 1)))
                low.append(False)
                high.append(False)
            elif cfg.variant == "vespo":
                k, lam = (
                    (cfg.vespo_k_pos, cfg.vespo_lambda_pos)
                    if a >= 0
                    else (cfg.vespo_k_neg, cfg.vespo_lambda_neg)
                )
                w_log = log_w
                if mode:  # TRL: the token weights' clamped logs join the summed log-ratio
                    clamped_is = sum(
                        min(max(math.log(w) if w > 0 else -math.inf, math.log(1e-8)), 20)
                        for tt, w in enumerate(weights)
                        if mask[i, tt]
                    )
                    w_log = min(max(clamped + clamped_is, math.log(1e-8)), 20.0)
                phi = math.exp(lam + k * w_log - lam * math.exp(w_log))
                val = -phi * a * lp
                low.append(False)
                high.append(False)
            else:  # cispo
                val = -min(rho, eh) * a * lp
                low.append(False)
                high.append(rho > eh and a > 0)
            if not keep:
                val = 0.0  # the off-policy mask acts before the KL term
            if mode and cfg.variant != "vespo":
                val *= weights[t]
            dropped.append(not keep)
            is_weights.append(weights[t])
            kl = 0.0
            if ref is not None:
                d = ref[i, t] - lp
                kl = math.exp(d) - d - 1
                val += cfg.beta * kl * (rho if cfg.kl_bias_correction else 1.0)
            ratios.append(rho)
            kls.append(kl)
            per[i, t] = val
    row_sum, row_tokens = per.sum(1), mask.sum(1)
    if tids is None:
        units = [[i] for i in range(rows)]
    else:
        units = [[i for i in range(rows) if tids[i] == u] for u in sorted(set(tids) - {-1})]
    n_units = len(units) if num_sequences is None else num_sequences
    aggregation = VARIANTS[cfg.variant].aggregation
    if aggregation == "sequence_mean":
        loss = sum(row_sum[u].sum() / max(row_tokens[u].sum(), 1) for u in units) / n_units
    elif aggregation == "sequence_sum":  # luspo: (1/N) sum_i |o_i| l_i
        loss = (
            sum(row_tokens[u].sum() * row_sum[u].sum() / max(row_tokens[u].sum(), 1) for u in units)
            / n_units
        )
    elif aggregation in ("token_mean_global", "token_mean_local"):
        loss = row_sum.sum() / max(row_tokens.sum(), 1)
    else:
        loss = row_sum.sum() / (n_units * cfg.max_completion_length)
    metrics = {
        "clip_low_fraction": np.mean(low) if low else 0.0,
        "clip_high_fraction": np.mean(high) if high else 0.0,
        "ratio_mean": np.mean(ratios) if ratios else 0.0,
        "kl_mean": np.mean(kls) if kls else 0.0,
        "tokens": float(mask.sum()),
        "off_policy_masked_fraction": np.mean(dropped) if dropped else 0.0,
        "sampler_weight_mean": np.mean(is_weights) if is_weights else 0.0,
        "sampler_weight_zero_fraction": np.mean(np.equal(is_weights, 0)) if is_weights else 0.0,
    }
    return loss, metrics


def random_batch(seed, masked_value=np.nan):
    rng = np.random.default_rng(seed)
    logps = rng.uniform(-3.0, -0.05, (B, T))
    old = logps + rng.normal(0, 0.3, (B, T))  # ratios on both sides of the clip range
    ref = logps + rng.normal(0, 0.2, (B, T))
    adv = rng.normal(0, 1, B)
    lengths = rng.integers(0, T + 1, B)
    lengths[0] = 0  # a fully masked row
    lengths[1] = T
    mask = np.arange(T)[None, :] < lengths[:, None]
    for array in (logps, old, ref):
        array[~mask] = masked_value  # padding junk must never leak
    return logps, old, ref, adv, mask


def run(cfg, logps, old, adv, mask, ref=None, tids=None, num_sequences=None, num_tokens=None,
        **kwargs):  # fmt: skip
    """policy_loss under jit on numpy inputs; the totals travel in the rows, as a micro-batch's."""
    f = jax.jit(policy_loss, static_argnums=0, static_argnames="num_micro_batches")
    to = jnp.asarray
    rows = LossRows(
        to(adv, jnp.float32),
        to(mask),
        None if tids is None else to(tids, jnp.int32),
        num_sequences,
        num_tokens,
    )
    ref = None if ref is None else to(ref, jnp.float32)
    return f(cfg, to(logps, jnp.float32), to(old, jnp.float32), rows, ref_logps=ref, **kwargs)


CASES = [
    config("grpo"),
    config("grpo", epsilon=0.1, epsilon_high=0.3, delta=1.5),
    config("bnpo", epsilon_high=0.28),
    config("dapo", epsilon_high=0.28, beta=0.04),
    config("dr_grpo", delta=2.0),
    config("cispo", beta=0.1),
    config("gspo", epsilon=3e-4, epsilon_high=4e-4),
    config("gspo", epsilon=0.05),
    config("sapo"),
    config("sapo", sapo_tau_pos=0.5, sapo_tau_neg=2.0, beta=0.04),
    config("luspo", epsilon=3e-4, epsilon_high=4e-4),
    config("luspo", epsilon=0.05, delta=1.05, beta=0.04),
    config("vespo"),
    config("vespo", vespo_k_pos=1.0, vespo_lambda_neg=0.5, beta=0.04),
    config("grpo", off_policy_mask_threshold=0.0),
    config("dapo", off_policy_mask_threshold=0.02, beta=0.04),
    config("grpo", sampler_correction="token_truncate", sampler_correction_min=0.95),
    config("dapo", sampler_correction="token_mask", sampler_correction_max=1.05),
    config("gspo", sampler_correction="sequence_truncate", sampler_correction_max=1.1),
    config("cispo", sampler_correction="sequence_mask", sampler_correction_max=1.2, beta=0.1),
    config("vespo", sampler_correction="token_mask", sampler_correction_max=1.05),
    config("grpo", beta=0.1, kl_bias_correction=True),
    config("gspo", beta=0.1, kl_bias_correction=True),
]
TRAJECTORIES = np.array([0, 0, 3, 1, 3, -1])  # rows 0,1 one trajectory; row 5 padding


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.variant}-d{c.delta}-b{c.beta}")
@pytest.mark.parametrize("trajectory_level", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_loss_and_metrics_equal_numpy_restatement(cfg, trajectory_level, seed):
    logps, old, ref, adv, mask = random_batch(seed)
    ref_in = ref if cfg.beta > 0 else None
    tids = TRAJECTORIES if trajectory_level else None
    # the sampler's log-probs: on seeds 0-1 their own (a gap on both sides of the threshold),
    # on 2-3 none given, so the off-policy mask falls back to the old log-probs (TRL's rule)
    sampler = logps + np.random.default_rng(seed).normal(0, 0.1, logps.shape)
    sampler = sampler if seed < 2 else None
    extra = {} if sampler is None else {"sampler_logps": jnp.asarray(sampler, jnp.float32)}
    loss, metrics = run(cfg, logps, old, adv, mask, ref_in, tids, **extra)
    want_loss, want_metrics = reference(cfg, logps, old, adv, mask, ref_in, tids, sampler=sampler)
    np.testing.assert_allclose(float(loss), want_loss, rtol=2e-5, atol=1e-6)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------- gradient properties


def grad_wrt_logps(cfg, logps, old, adv, mask, **kwargs):
    def f(lp):
        return run(cfg, lp, old, adv, mask, **kwargs)[0]

    return np.asarray(jax.grad(f)(jnp.asarray(logps, jnp.float32)))


def weights(cfg, mask, tids=None):
    """The aggregation weight of each token: d loss / d per-token loss."""
    aggregation = VARIANTS[cfg.variant].aggregation
    units = np.arange(mask.shape[0]) if tids is None else np.asarray(tids)
    mask = mask & (units >= 0)[:, None]
    n_units = len(set(units.tolist()) - {-1})
    unit_tokens = np.array([mask[units == u].sum() for u in units])
    w = {
        "sequence_mean": 1.0 / (n_units * np.maximum(unit_tokens, 1)),
        "sequence_sum": np.full(len(units), 1.0 / n_units),
        "token_mean_global": np.full(len(units), 1.0 / mask.sum()),
        "token_mean_local": np.full(len(units), 1.0 / mask.sum()),
        "fixed_length": np.full(len(units), 1.0 / (n_units * L)),
    }[aggregation]
    return np.where(mask, w[:, None], 0.0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("trajectory_level", [False, True])
def test_gradient_at_ratio_one_is_minus_advantage_times_weight(variant, trajectory_level):
    cfg = config(variant)
    logps, _, _, adv, mask = random_batch(7, masked_value=-np.inf)
    tids = TRAJECTORIES if trajectory_level else None
    old = np.where(mask, logps, 0.0)  # ratio exactly 1 on every token
    grad = grad_wrt_logps(cfg, logps, old, adv, mask, tids=tids)
    want = -adv[:, None] * weights(cfg, mask, tids)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)


def clipped_batch(advantage, log_ratio):
    logps = np.full((2, 3), -1.0)
    old = logps - log_ratio
    return logps, old, np.full(2, advantage), np.ones((2, 3), bool)


@pytest.mark.parametrize("variant", [*CLIPPED, "gspo", "luspo"])
@pytest.mark.parametrize(("advantage", "log_ratio"), [(1.0, 0.5), (-1.0, -0.5)])
def test_gradient_vanishes_in_clipped_regions(variant, advantage, log_ratio):
    # rho = e^0.5 > 1 + 0.2 with A > 0, and rho = e^-0.5 < 1 - 0.2 with A < 0
    cfg = config(variant)
    grad = grad_wrt_logps(cfg, *clipped_batch(advantage, log_ratio))
    np.testing.assert_array_equal(grad, 0.0)
    _, metrics = run(cfg, *clipped_batch(advantage, log_ratio))
    side = "clip_high_fraction" if advantage > 0 else "clip_low_fraction"
    assert float(metrics[side]) == 1.0


@pytest.mark.parametrize(("advantage", "log_ratio"), [(1.0, 3.0), (-1.0, -3.0), (1.0, 0.5)])
def test_cispo_gradient_never_vanishes(advantage, log_ratio):
    cfg = config("cispo")
    grad = grad_wrt_logps(cfg, *clipped_batch(advantage, log_ratio))
    rho = min(math.exp(log_ratio), 5.0)
    np.testing.assert_allclose(grad, -advantage * rho / 6, rtol=1e-5)


@pytest.mark.parametrize(("advantage", "log_ratio"), [(1.0, 0.5), (-1.0, -0.5), (2.0, -3.0)])
def test_sapo_gradient_is_the_soft_gate_derivative_and_never_vanishes(advantage, log_ratio):
    """d/dl of -(4/tau) sigmoid(tau (rho - 1)) A is -4 sigma (1 - sigma) rho A: smaller as rho
    leaves 1, never zero as the hard clip's is."""
    cfg = config("sapo")
    grad = grad_wrt_logps(cfg, *clipped_batch(advantage, log_ratio))
    rho, tau = math.exp(log_ratio), 1.0 if advantage > 0 else 1.05
    sigma = 1 / (1 + math.exp(-tau * (rho - 1)))
    want = -4 * sigma * (1 - sigma) * rho * advantage / 6  # mean of 2 rows of 3 tokens
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    assert np.all(grad != 0)


@pytest.mark.parametrize(("advantage", "log_ratio"), [(1.0, 0.2), (-1.0, -0.1), (1.0, 3.0)])
def test_vespo_gradient_is_reinforce_scaled_by_the_stopped_gamma_weight(advantage, log_ratio):
    cfg = config("vespo")
    grad = grad_wrt_logps(cfg, *clipped_batch(advantage, log_ratio))
    k, lam = (2.0, 3.0) if advantage >= 0 else (3.0, 2.0)
    log_w = 3 * log_ratio  # the sum over the row's 3 tokens
    phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
    np.testing.assert_allclose(grad, -phi * advantage / 6, rtol=1e-5, atol=1e-12)  # 6 tokens


def test_luspo_weighs_a_sequence_by_its_length_where_gspo_does_not():
    logps, old, _, adv, mask = random_batch(4)
    old = np.where(mask, logps, 0.0)  # ratio 1: each row's loss is -A
    lengths = mask.sum(1)
    for variant, want in [
        ("gspo", -adv[lengths > 0].sum() / B),
        ("luspo", -(adv * lengths).sum() / B),
    ]:
        loss, _ = run(config(variant), logps, old, adv, mask)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_off_policy_mask_drops_only_negative_rows_the_sampler_has_drifted_from():
    logps = np.full((4, 3), -1.0)
    adv = np.array([1.0, -1.0, -1.0, 1.0])
    mask = np.ones((4, 3), bool)
    sampler = logps + np.array([[0.5], [0.5], [0.01], [0.5]])  # mean gaps 0.5, 0.5, 0.01, 0.5
    cfg = config("grpo", off_policy_mask_threshold=0.1)
    out = {"sampler_logps": jnp.asarray(sampler, jnp.float32)}
    grad = grad_wrt_logps(cfg, logps, logps, adv, mask, **out)
    np.testing.assert_array_equal(grad[1], 0.0)  # A < 0 and gap 0.5 > 0.1: dropped
    assert np.all(grad[[0, 2, 3]] != 0)  # A >= 0, or a small gap: kept
    _, metrics = run(cfg, logps, logps, adv, mask, **out)
    assert float(metrics["off_policy_masked_fraction"]) == 0.25


def test_delta_caps_the_unclipped_term():
    cfg = config("grpo", delta=1.5)
    logps, old, adv, mask = clipped_batch(-1.0, 1.0)  # rho = e > delta, A < 0
    loss, _ = run(cfg, logps, old, adv, mask)
    np.testing.assert_allclose(float(loss), 1.5, rtol=1e-6)
    np.testing.assert_array_equal(grad_wrt_logps(cfg, logps, old, adv, mask), 0.0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("junk", [np.nan, -np.inf, np.inf])
def test_masked_positions_never_produce_nan(variant, junk):
    cfg = config(variant, beta=0.1)
    logps, old, ref, adv, mask = random_batch(3, masked_value=junk)

    def f(lp):
        return run(cfg, lp, old, adv, mask, ref)[0]

    loss, grad = jax.value_and_grad(f)(jnp.asarray(logps, jnp.float32))
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~mask] == 0)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fully_masked_row_contributes_nothing(variant):
    cfg = config(variant)
    logps, old, _, adv, mask = random_batch(5)
    assert not mask[0].any()
    grad = grad_wrt_logps(cfg, logps, old, adv, mask)
    assert np.all(grad[0] == 0)
    adv_changed = adv.copy()
    adv_changed[0] = 1e6
    same = run(cfg, logps, old, adv_changed, mask)[0]
    np.testing.assert_allclose(float(same), float(run(cfg, logps, old, adv, mask)[0]), rtol=1e-6)


@pytest.mark.parametrize("variant", ["grpo", "dapo", "dr_grpo", "cispo", "gspo"])
@pytest.mark.parametrize("trajectory_level", [False, True])
def test_micro_batches_with_step_totals_sum_to_the_full_loss(variant, trajectory_level):
    cfg = config(variant, beta=0.05)
    logps, old, ref, adv, mask = random_batch(11)
    tids = np.array([0, 0, 1, 1, 2, 2]) if trajectory_level else None
    full, _ = run(cfg, logps, old, adv, mask, ref, tids)
    totals = {"num_sequences": 3 if trajectory_level else B, "num_tokens": int(mask.sum())}
    parts = 0.0
    for rows in (slice(0, 2), slice(2, 6)):  # trajectories stay whole
        part_ids = None if tids is None else tids[rows] - tids[rows].min()
        part, _ = run(
            cfg, logps[rows], old[rows], adv[rows], mask[rows], ref[rows], part_ids, **totals
        )
        parts += float(part)
    np.testing.assert_allclose(parts, float(full), rtol=1e-5, atol=1e-7)


def test_bnpo_averages_micro_batch_token_means():
    cfg = config("bnpo")
    logps, old, _, adv, mask = random_batch(12)
    halves = [slice(0, 3), slice(3, 6)]
    means = [reference(cfg, logps[h], old[h], adv[h], mask[h])[0] for h in halves]
    parts = [
        float(run(cfg, logps[h], old[h], adv[h], mask[h], num_micro_batches=2)[0]) for h in halves
    ]
    np.testing.assert_allclose(sum(parts), np.mean(means), rtol=1e-5)


# ---------------------------------------------------------------- configuration errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "ppo"}, "variant must be a registered loss .* got 'ppo'"),
        ({"variant": "dr_grpo", "max_completion_length": 0}, "got 0"),
        ({"variant": "grpo", "epsilon": -0.1}, "epsilon must be >= 0, got -0.1"),
        ({"variant": "grpo", "epsilon_high": -1.0}, "epsilon_high must be >= 0, got -1.0"),
        ({"variant": "grpo", "beta": -0.01}, "beta must be >= 0, got -0.01"),
        ({"variant": "grpo", "delta": 0.9}, "delta must be > 1, got 0.9"),
        (
            {"variant": "gspo", "delta": 2.0},
            r"delta applies to \[.bnpo., .dapo., .dr_grpo., .grpo., .luspo.\], not .gspo.",
        ),
        ({"variant": "sapo", "sapo_tau_neg": 0.0}, "sapo_tau_neg must be > 0, got 0.0"),
        ({"variant": "vespo", "vespo_lambda_pos": -1.0}, "vespo_lambda_pos must be > 0"),
        (
            {"variant": "vespo", "sampler_correction": "sequence_mask"},
            "sampler_correction='sequence_mask' with vespo: it folds a per-token weight",
        ),
        ({"off_policy_mask_threshold": float("nan")}, "off_policy_mask_threshold must be a"),
        ({"variant": "cispo"}, "epsilon_high is cispo's absolute cap .* got None"),
        ({"variant": "cispo", "epsilon_high": 0.2}, "got 0.2"),
    ],
)
def test_bad_configs_name_field_and_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**kwargs)


def test_epsilon_high_defaults_to_epsilon_without_rewriting_the_field():
    cfg = LossConfig("grpo", epsilon=0.3)
    assert cfg.epsilon_high is None and cfg.eps_high == 0.3
    assert dataclasses.replace(cfg, epsilon=0.1).eps_high == 0.1


def test_dr_grpo_without_its_normaliser_is_an_error_at_the_loss():
    logps, old, _, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match=r"needs LossConfig\.max_completion_length"):
        run(LossConfig("dr_grpo"), logps, old, adv, mask)


def test_beta_without_reference_is_an_error():
    logps, old, _, adv, mask = random_batch(0)
    with pytest.raises(ValueError, match="needs ref_logps"):
        run(config("grpo", beta=0.1), logps, old, adv, mask)


@pytest.mark.parametrize(
    ("terms", "message"),
    [
        # a per-row loss would broadcast over the tokens: the wrong number, silently
        (
            lambda x: TokenTerms((-x.advantages * x.logps).sum(-1), x.logps, x.mask, x.mask),
            r"returned TokenTerms.loss of shape \(6,\); every term must be \[B, T\]=\(6, 7\)",
        ),
        (
            lambda x: TokenTerms(-x.advantages * x.logps, 1.0, x.mask, x.mask),
            r"returned TokenTerms.ratio of shape float; every term must be",
        ),
        (lambda x: (-x.advantages * x.logps,), "returned a tuple, not TokenTerms"),
    ],
)
def test_a_registered_loss_with_wrong_shapes_is_refused_naming_the_term(terms, message):
    register_loss("misshapen", lambda cfg, x: terms(x), aggregation="token_mean_global")
    try:
        logps, old, _, adv, mask = random_batch(0)
        with pytest.raises((ValueError, TypeError), match=rf"loss variant 'misshapen' {message}"):
            run(LossConfig("misshapen"), logps, old, adv, mask)
    finally:
        VARIANTS.pop("misshapen")


def test_a_registered_aggregation_reduces_a_registered_loss():
    """An aggregation is one function of UnitSums; a loss names it like a built-in."""
    register_aggregation("halved_token_sum", lambda x: x.row_sum.sum() / 2)
    register_loss(
        "reinforce_sum",
        lambda cfg, x: TokenTerms(
            -x.advantages * x.logps, jnp.exp(x.log_ratio), x.mask & False, x.mask & False
        ),
        aggregation="halved_token_sum",
    )
    try:
        logps, old, _, adv, mask = random_batch(2)
        loss, _ = run(LossConfig("reinforce_sum"), logps, old, adv, mask)
        want = sum(-adv[i] * logps[i, t] for i in range(B) for t in range(T) if mask[i, t]) / 2
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
        with pytest.raises(ValueError, match=r"aggregation of loss 'x' must be a registered"):
            register_loss("x", lambda cfg, x: None, aggregation="no_such")
    finally:
        VARIANTS.pop("reinforce_sum")
        AGGREGATIONS.pop("halved_token_sum")
