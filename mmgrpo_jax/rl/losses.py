"""Policy-gradient losses: per-token objectives and their aggregations (docs/design.md#losses).

A variant is one per-token function with the shared signature `(cfg, TokenInputs) -> TokenTerms`
plus the name of its aggregation, registered with `register_loss`; an aggregation is one
function of `UnitSums`, registered with `register_aggregation` (the built-ins below are
registered the same way). Everything is float32, masked with `where` on the inputs as well as
the outputs, so padding holding -inf or NaN log-probs never reaches a gradient. Shapes: B rows,
T completion positions. The unit a sequence-level aggregation normalises by is the row, or a
group of rows sharing a unit id (trajectory-level grouping: all calls of one trajectory).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from mmgrpo_jax.config_files import setting
from mmgrpo_jax.errors import check_field_types
from mmgrpo_jax.rl.registry import Registry


@dataclasses.dataclass(frozen=True)
class UnitSums:
    """What an aggregation reads: the masked per-token loss summed per row and per unit (rows
    sharing a unit id), token counts, and the step's totals (under gradient accumulation the
    whole step's, so that the micro-batch losses sum to the step's loss)."""

    row_sum: jax.Array  # [B]
    row_tokens: jax.Array  # [B]
    unit_sum: jax.Array  # [B] indexed by unit id; 0 for ids no row has
    unit_tokens: jax.Array  # [B]
    units: jax.Array  # the step's number of units (>= 1)
    tokens: jax.Array  # the step's completion tokens (>= 1)
    num_micro_batches: int
    fixed_length: int | None  # dr_grpo's max_completion_length


Aggregator = Callable[[UnitSums], jax.Array]
AGGREGATIONS: Registry[Aggregator] = Registry("aggregation", "mmgrpo_jax.register_aggregation")


def register_aggregation(name: str, aggregate: Aggregator) -> None:
    """Make `register_loss(..., aggregation=name)` reduce the per-token loss with `aggregate`."""
    AGGREGATIONS.add(name, aggregate, aggregate)


def _sequence_mean(x: UnitSums) -> jax.Array:
    """Each unit's token mean, averaged over units: every unit weighs the same."""
    return jnp.sum(x.unit_sum / jnp.maximum(x.unit_tokens, 1)) / x.units


def _sequence_sum(x: UnitSums) -> jax.Array:
    """Each unit's token sum, averaged over units: a unit weighs by its length (luspo)."""
    return x.row_sum.sum() / x.units


def _token_mean_global(x: UnitSums) -> jax.Array:
    """Every token of the step alike (dapo, cispo)."""
    return x.row_sum.sum() / x.tokens


def _token_mean_local(x: UnitSums) -> jax.Array:
    """The micro-batch's token mean, averaged over micro-batches (bnpo)."""
    return x.row_sum.sum() / jnp.maximum(x.row_tokens.sum(), 1) / x.num_micro_batches


def _fixed_length(x: UnitSums) -> jax.Array:
    """Tokens summed over units x a constant length (dr_grpo)."""
    return x.row_sum.sum() / (x.units * x.fixed_length)


register_aggregation("sequence_mean", _sequence_mean)
register_aggregation("sequence_sum", _sequence_sum)
register_aggregation("token_mean_global", _token_mean_global)
register_aggregation("token_mean_local", _token_mean_local)
register_aggregation("fixed_length", _fixed_length)


@dataclasses.dataclass(frozen=True)
class TokenInputs:
    """What a per-token objective may read; `batch` holds every other per-row input by name."""

    logps: jax.Array  # [B, T] trainer log-probs (masked, float32); gradients flow here
    old_logps: jax.Array  # [B, T] constant
    log_ratio: jax.Array  # [B, T] logps - old_logps on the mask, 0 elsewhere
    advantages: jax.Array  # [B, 1] constant
    mask: jax.Array  # [B, T] bool, completion tokens only
    batch: Any = None  # the rows policy_loss got: the micro-batch (rl.batch.Batch) in training
    # log of the sampler-mismatch weight (LossConfig.sampler_correction), [B, T] or [B, 1];
    # None when off. policy_loss applies it to every variant but vespo, which folds it in itself
    is_log_weight: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class TokenTerms:
    loss: jax.Array  # [B, T] per-token loss before masking and aggregation
    ratio: jax.Array  # [B, T] the importance ratio the objective used
    clipped_low: jax.Array  # [B, T] bool
    clipped_high: jax.Array  # [B, T] bool


TokenObjective = Callable[["LossConfig", TokenInputs], TokenTerms]


def _check_terms(variant: str, terms: Any, shape: tuple[int, ...]) -> None:
    """A registered objective's TokenTerms must be [B, T] each: a [B] or scalar term would
    broadcast silently into a wrong loss. Shapes are static: this runs once, at trace time."""
    if not isinstance(terms, TokenTerms):
        raise TypeError(
            f"loss variant {variant!r} returned a {type(terms).__name__}, not TokenTerms"
        )
    for field in dataclasses.fields(TokenTerms):
        got = getattr(terms, field.name)
        if getattr(got, "shape", None) != shape:
            raise ValueError(
                f"loss variant {variant!r} returned TokenTerms.{field.name} of shape "
                f"{getattr(got, 'shape', type(got).__name__)}; every term must be [B, T]={shape}"
            )


@dataclasses.dataclass(frozen=True)
class Variant:
    token_terms: TokenObjective
    aggregation: str  # a registered aggregation
    uses_delta: bool = False
    # takes the sampler-mismatch weight in its token function (`TokenInputs.is_log_weight`)
    # instead of having policy_loss multiply its per-token loss by it; token modes only
    folds_sampler_weight: bool = False


VARIANTS: Registry[Variant] = Registry("loss", "mmgrpo_jax.register_loss")


def register_loss(
    name: str,
    token_terms: TokenObjective,
    *,
    aggregation: str = "sequence_mean",
    uses_delta: bool = False,
    folds_sampler_weight: bool = False,
) -> None:
    """Make `LossConfig(variant=name)` train with `token_terms`, aggregated by `aggregation`.

    `token_terms(cfg, inputs)` returns the per-token loss (to minimise) and its ratio and clip
    masks for the metrics; `inputs.batch` gives any extra per-token input added to the batch.
    """
    AGGREGATIONS.lookup(aggregation, f"the aggregation of loss {name!r}")
    variant = Variant(token_terms, aggregation, uses_delta, folds_sampler_weight)
    VARIANTS.add(name, token_terms, variant)


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Which objective to minimise and its clipping/KL constants.

    `epsilon_high` defaults to `epsilon` for the clipped variants; for cispo it is an absolute cap
    on the ratio (TRL's form) and must be given, e.g. 5.0. `delta` (two-sided clipping) applies to
    grpo, bnpo, dapo, dr_grpo and luspo. `max_completion_length` is dr_grpo's constant
    normaliser: left unset in an MMGRPOConfig it becomes the sampler's `max_completion_tokens`.
    """

    variant: str = setting(
        "grpo",
        ("grpo | bnpo | dapo | dr_grpo | cispo | gspo | sapo | luspo | vespo, or a registered one"),
    )
    epsilon: float = setting(0.2, "the lower clip: rho >= 1 - epsilon")
    epsilon_high: float | None = setting(None, "the upper clip (cispo: the cap); null: epsilon")
    delta: float | None = setting(None, "two-sided clipping: rho <= delta in the unclipped term")
    beta: float = setting(0.0, "the k3 KL to the base weights (LoRA off); 0: no reference pass")
    max_completion_length: int | None = setting(None, "dr_grpo's normaliser; null: the sampler's")
    sapo_tau_pos: float = setting(1.0, "sapo's gate temperature for A > 0")
    sapo_tau_neg: float = setting(1.05, "and for A <= 0")
    vespo_k_pos: float = setting(
        2.0, "vespo's gamma weight phi(w) = exp(lam + k log w - lam w), A >= 0"
    )
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = setting(3.0, "and for A < 0")
    vespo_lambda_neg: float = 2.0
    aggregation: str | None = setting(
        None,
        ("a registered aggregation in place of the variant's own; MMGRPOConfig.loss_unit sets it"),
    )
    sampler_correction: str | None = setting(
        None,
        (
            "sampler-mismatch correction (TRL's vllm_importance_sampling_mode): "
            "token_truncate | token_mask | sequence_truncate | sequence_mask; null: off. "
            "The weight exp(l_old - l_sampler) (per token, or its sum per sequence) is "
            "clamped to, or zeroed outside, [min, max]"
        ),
    )
    sampler_correction_min: float | None = setting(None, "null: no lower bound")
    sampler_correction_max: float | None = setting(3.0, "null: no upper bound")
    kl_bias_correction: bool = setting(
        False,
        (
            "the KL term weighted by the importance ratio (TRL's use_bias_correction_kl, on"
            " by default there): the unbiased reverse-KL gradient; changes the gradient "
            "even at ratio 1"
        ),
    )
    off_policy_mask_threshold: float | None = setting(
        None,
        (
            "DeepSeek-V3.2's off-policy sequence mask: a row with A < 0 whose mean (sampler"
            " - trainer) log-prob gap is above this drops out of the loss; null: off"
        ),
    )

    @property
    def aggregation_name(self) -> str:
        """The aggregation this loss reduces with: `aggregation`, else the variant's."""
        return self.aggregation or VARIANTS[self.variant].aggregation

    @property
    def eps_high(self) -> float:
        """The upper clip (or cispo's cap): `epsilon_high`, else `epsilon`."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def __post_init__(self) -> None:
        check_field_types(self)
        VARIANTS.lookup(self.variant, "LossConfig.variant")
        if self.aggregation is not None:
            AGGREGATIONS.lookup(self.aggregation, "LossConfig.aggregation")
        if not self.epsilon >= 0:
            raise ValueError(f"LossConfig.epsilon must be >= 0, got {self.epsilon!r}")
        if self.variant == "cispo" and (self.epsilon_high is None or self.epsilon_high < 1):
            raise ValueError(
                "LossConfig.epsilon_high is cispo's absolute cap on the ratio and must be >= 1 "
                f"(e.g. 5.0), got {self.epsilon_high!r}"
            )
        if not self.eps_high >= 0:
            raise ValueError(f"LossConfig.epsilon_high must be >= 0, got {self.epsilon_high!r}")
        if self.delta is not None:
            if not VARIANTS[self.variant].uses_delta:
                takers = sorted(name for name, v in VARIANTS.items() if v.uses_delta)
                raise ValueError(
                    f"LossConfig.delta applies to {takers}, not {self.variant!r}; got "
                    f"delta={self.delta!r}"
                )
            if not self.delta > 1:
                raise ValueError(f"LossConfig.delta must be > 1, got {self.delta!r}")
        if not self.beta >= 0:
            raise ValueError(f"LossConfig.beta must be >= 0, got {self.beta!r}")
        for name in ("sapo_tau_pos", "sapo_tau_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LossConfig.{name} must be > 0, got {getattr(self, name)!r}")
        self._check_sampler_correction()
        threshold = self.off_policy_mask_threshold
        if threshold is not None and not math.isfinite(threshold):
            raise ValueError(
                f"LossConfig.off_policy_mask_threshold must be a finite number or null, got "
                f"{threshold!r}"
            )
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise ValueError(
                "LossConfig.max_completion_length must be a positive int or null, got "
                f"{self.max_completion_length!r}"
            )

    def _check_sampler_correction(self) -> None:
        mode = self.sampler_correction
        if mode is None:
            return
        if mode not in SAMPLER_CORRECTIONS:
            raise ValueError(
                f"LossConfig.sampler_correction must be one of {SAMPLER_CORRECTIONS} or null, "
                f"got {mode!r}"
            )
        low, high = self.sampler_correction_min, self.sampler_correction_max
        if low is not None and not low >= 0:
            raise ValueError(f"LossConfig.sampler_correction_min must be >= 0, got {low!r}")
        if high is not None and not (high > 0 and (low is None or high > low)):
            raise ValueError(
                f"LossConfig.sampler_correction_max must be > 0 and > sampler_correction_min, "
                f"got {high!r}"
            )
        if VARIANTS[self.variant].folds_sampler_weight and mode.startswith("sequence"):
            raise ValueError(
                f"LossConfig.sampler_correction={mode!r} with {self.variant}: it folds a "
                "per-token weight into its own (as TRL's vespo); use token_truncate or token_mask"
            )


SAMPLER_CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_log_weight(
    cfg: LossConfig,
    old_logps: jax.Array,  # [B, T] the trainer's, before the step's first update
    sampler_logps: jax.Array,  # [B, T] what the tokens were sampled with
    mask: jax.Array,  # [B, T]
) -> jax.Array:
    """log of TRL's sampler-mismatch weight: log r = l_old - l_sampler per token ([B, T]), or
    its sum per sequence ([B, 1]), clamped to (truncate) or -inf outside (mask) [min, max]."""
    diff = jnp.where(mask, old_logps - sampler_logps, 0.0)
    diff = jnp.nan_to_num(diff, nan=0.0)  # as TRL: NaN counts 0 (r = 1), +-inf the largest float
    mode = cfg.sampler_correction
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdims=True)
    low = -jnp.inf if cfg.sampler_correction_min is None else jnp.log(cfg.sampler_correction_min)
    high = jnp.inf if cfg.sampler_correction_max is None else jnp.log(cfg.sampler_correction_max)
    if mode.endswith("truncate"):
        return jnp.clip(diff, low, high)
    return jnp.where((diff < low) | (diff > high), -jnp.inf, diff)


def _ppo_clip(cfg: LossConfig, ratio: jax.Array, advantages: jax.Array) -> TokenTerms:
    """-min(rho A, clip(rho, 1-e, 1+eh) A), rho capped at delta in the first term when set."""
    unclipped = ratio if cfg.delta is None else jnp.minimum(ratio, cfg.delta)
    clipped = jnp.clip(ratio, 1 - cfg.epsilon, 1 + cfg.eps_high)
    loss = -jnp.minimum(unclipped * advantages, clipped * advantages)
    low = (ratio < 1 - cfg.epsilon) & (advantages < 0)
    high = (ratio > 1 + cfg.eps_high) & (advantages > 0)
    return TokenTerms(loss, ratio, low, high)


def _clipped_terms(cfg: LossConfig, x: TokenInputs) -> TokenTerms:
    """GRPO/BNPO/DAPO/Dr. GRPO: PPO-clip on each token's ratio."""
    return _ppo_clip(cfg, jnp.exp(x.log_ratio), x.advantages)


def _gspo_terms(cfg: LossConfig, x: TokenInputs) -> TokenTerms:
    """GSPO: PPO-clip on the length-normalised sequence ratio, its gradient reaching every token."""
    lengths = jnp.maximum(x.mask.sum(-1, keepdims=True), 1)
    ratio = jnp.exp(x.log_ratio.sum(-1, keepdims=True) / lengths) * jnp.ones_like(x.log_ratio)
    return _ppo_clip(cfg, ratio, x.advantages)  # delta is rejected for gspo by LossConfig


def _cispo_terms(cfg: LossConfig, x: TokenInputs) -> TokenTerms:
    """CISPO: REINFORCE weighted by the capped, stop-gradient ratio; never zero gradient."""
    ratio = jnp.exp(x.log_ratio)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, cfg.eps_high))
    loss = -weight * x.advantages * x.logps
    high = (ratio > cfg.eps_high) & (x.advantages > 0)
    return TokenTerms(loss, ratio, jnp.zeros_like(high), high)


def _sapo_terms(cfg: LossConfig, x: TokenInputs) -> TokenTerms:
    """SAPO: a soft gate, -(4/tau) sigmoid(tau (rho - 1)) A, in place of the hard clip; its
    gradient fades smoothly as rho leaves 1 instead of stopping (tau by the advantage's sign)."""
    ratio = jnp.exp(x.log_ratio)
    tau = jnp.where(x.advantages > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    loss = -(4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0)) * x.advantages
    none = jnp.zeros(ratio.shape, bool)
    return TokenTerms(loss, ratio, none, none)


def _vespo_terms(cfg: LossConfig, x: TokenInputs) -> TokenTerms:
    """VESPO: REINFORCE weighted by a gamma function of the sequence ratio, phi(w) = exp(lam +
    k log w - lam w) (phi(1) = 1), with log w the *sum* of the clamped token log-ratios."""
    log_ratio = jnp.where(x.mask, jnp.clip(x.log_ratio, -20.0, 20.0), 0.0)
    log_w = log_ratio.sum(-1, keepdims=True)
    if x.is_log_weight is not None:  # TRL: the token weights' clamped logs join the sum
        log_is = jnp.clip(x.is_log_weight, math.log(1e-8), 20.0)
        log_w = log_w + jnp.where(x.mask, log_is, 0.0).sum(-1, keepdims=True)
    log_w = jnp.clip(log_w, math.log(1e-8), 20.0)  # [B, 1]
    positive = x.advantages >= 0
    k = jnp.where(positive, cfg.vespo_k_pos, cfg.vespo_k_neg)
    lam = jnp.where(positive, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    phi = jax.lax.stop_gradient(jnp.where(jnp.isfinite(phi), phi, 0.0))
    loss = -phi * x.advantages * x.logps
    none = jnp.zeros(x.logps.shape, bool)
    return TokenTerms(loss, jnp.exp(x.log_ratio), none, none)  # the token ratio, as TRL's


register_loss("grpo", _clipped_terms, aggregation="sequence_mean", uses_delta=True)
register_loss("bnpo", _clipped_terms, aggregation="token_mean_local", uses_delta=True)
register_loss("dapo", _clipped_terms, aggregation="token_mean_global", uses_delta=True)
register_loss("dr_grpo", _clipped_terms, aggregation="fixed_length", uses_delta=True)
register_loss("cispo", _cispo_terms, aggregation="token_mean_global")
register_loss("gspo", _gspo_terms, aggregation="sequence_mean")
register_loss("sapo", _sapo_terms, aggregation="sequence_mean")
# LUSPO: GSPO's sequence ratio, each sequence's loss weighted by its length: (1/N) sum |o_i| l_i
register_loss("luspo", _gspo_terms, aggregation="sequence_sum", uses_delta=True)
register_loss("vespo", _vespo_terms, aggregation="token_mean_global", folds_sampler_weight=True)


def off_policy_keep(
    advantages: jax.Array,  # [B, 1]
    logps: jax.Array,  # [B, T] trainer log-probs
    sampler_logps: jax.Array,  # [B, T] the log-probs the tokens were sampled with
    mask: jax.Array,  # [B, T]
    threshold: float,
) -> jax.Array:
    """DeepSeek-V3.2's off-policy sequence mask, [B, 1]: a row stays unless its advantage is
    negative and its mean (sampler - trainer) log-prob gap, a KL estimate, exceeds `threshold`."""
    gap = jnp.where(mask, sampler_logps - jax.lax.stop_gradient(logps), 0.0)
    gap = jnp.nan_to_num(gap, nan=0.0)  # as TRL: NaN counts 0, +-inf the largest float
    mean_gap = gap.sum(-1, keepdims=True) / jnp.maximum(mask.sum(-1, keepdims=True), 1)
    return (advantages >= 0) | (mean_gap <= threshold)


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(mask.sum(), 1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["advantages", "loss_mask", "unit_ids", "num_sequences", "num_tokens"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class LossRows:
    """The per-row inputs a loss reads, by the names a micro-batch (`rl.batch.Batch`) has them:
    the trainer passes its micro-batch, a loss computed on its own passes this."""

    advantages: jax.Array  # [B]
    loss_mask: jax.Array  # [B, T] completion tokens only
    unit_ids: jax.Array | None = None  # [B] ids in [0, B), -1 = padding row; None: row units
    num_sequences: jax.Array | int | None = None  # the whole step's units; None: this batch's
    num_tokens: jax.Array | int | None = None  # the whole step's completion tokens; None: this


def policy_loss(
    cfg: LossConfig,
    logps: jax.Array,  # [B, T] trainer log-probs, gradients flow here
    old_logps: jax.Array,  # [B, T] log-probs before this step's first update (constant)
    rows: Any,  # LossRows, or a micro-batch with those fields
    *,
    ref_logps: jax.Array | None = None,  # [B, T] base model (LoRA off), needed when beta > 0
    sampler_logps: jax.Array | None = None,  # [B, T] the sampler's; the off-policy mask's input
    num_micro_batches: int = 1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss to minimise and its metrics, docs/design.md#losses.

    `rows.unit_ids` say which rows form one sequence unit of the aggregation (rows sharing an id
    are one unit, e.g. a trajectory in trajectory-level mmGRPO; all of a unit's rows must be in
    this call); without them every row is its own unit. Under gradient accumulation the rows
    carry the whole step's `num_sequences` (units) and `num_tokens`, so that summing the
    micro-batch losses gives the step's loss; without them both are counted in this batch. bnpo
    averages micro-batch token means by definition, so it takes `num_micro_batches` instead.
    `rows` reaches the variant's token function as `inputs.batch`. `sampler_logps` (else the old
    log-probs, TRL's fallback) feed the off-policy sequence mask and the sampler-mismatch weight,
    when either is set.
    """
    advantages, mask, unit_ids = rows.advantages, rows.loss_mask, rows.unit_ids
    num_sequences, num_tokens = rows.num_sequences, rows.num_tokens
    if cfg.beta > 0 and ref_logps is None:
        raise ValueError(f"LossConfig.beta={cfg.beta} needs ref_logps for the KL term")
    if logps.ndim != 2 or logps.shape != old_logps.shape or logps.shape != mask.shape:
        raise ValueError(
            f"logps, old_logps and mask must share one [B, T] shape, got {logps.shape}, "
            f"{old_logps.shape}, {mask.shape}"
        )
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be [B]={logps.shape[:1]}, got {advantages.shape}")
    variant = VARIANTS[cfg.variant]
    fixed_length = cfg.max_completion_length
    if cfg.aggregation_name == "fixed_length" and fixed_length is None:
        raise ValueError(
            f"loss variant {cfg.variant!r} needs LossConfig.max_completion_length (an MMGRPOConfig "
            "sets it to max_completion_tokens)"
        )
    mask = mask.astype(bool)
    if unit_ids is not None:
        mask = mask & (unit_ids >= 0)[:, None]  # padding rows are out of every sum
    logps = jnp.where(mask, logps.astype(jnp.float32), 0.0)
    old_logps = jax.lax.stop_gradient(jnp.where(mask, old_logps.astype(jnp.float32), 0.0))
    log_ratio = jnp.where(mask, logps - old_logps, 0.0)
    adv = jax.lax.stop_gradient(advantages.astype(jnp.float32))[:, None]  # [B, 1]

    behaviour = old_logps
    if sampler_logps is not None:
        behaviour = jax.lax.stop_gradient(jnp.where(mask, sampler_logps.astype(jnp.float32), 0.0))
    is_log = None
    if cfg.sampler_correction is not None:
        is_log = sampler_log_weight(cfg, old_logps, behaviour, mask)
    inputs = TokenInputs(logps, old_logps, log_ratio, adv, mask, rows, is_log)
    terms = variant.token_terms(cfg, inputs)
    _check_terms(cfg.variant, terms, mask.shape)
    per_token = terms.loss
    kept = jnp.ones_like(adv, bool)
    if cfg.off_policy_mask_threshold is not None:
        kept = off_policy_keep(adv, logps, behaviour, mask, cfg.off_policy_mask_threshold)
        per_token = jnp.where(kept, per_token, 0.0)  # before the KL term, as TRL
    is_weight = jnp.ones_like(per_token)
    if is_log is not None:
        is_weight = jnp.broadcast_to(jnp.exp(is_log), per_token.shape)
        if not variant.folds_sampler_weight:
            per_token = per_token * is_weight
    kl = jnp.zeros_like(per_token)
    if ref_logps is not None:
        ref = jax.lax.stop_gradient(jnp.where(mask, ref_logps.astype(jnp.float32), 0.0))
        kl = jnp.exp(ref - logps) - (ref - logps) - 1.0  # k3 estimator
        weighted_kl = kl * terms.ratio if cfg.kl_bias_correction else kl
        per_token = per_token + cfg.beta * weighted_kl
    per_token = jnp.where(mask, per_token, 0.0)

    row_sum, row_tokens = per_token.sum(-1), mask.sum(-1).astype(jnp.float32)  # [B]
    if unit_ids is None:
        unit_sum, unit_tokens, present = row_sum, row_tokens, row_sum.shape[0]
    else:
        b = row_sum.shape[0]
        segment = jnp.where(unit_ids >= 0, unit_ids, b)
        unit_sum = jax.ops.segment_sum(row_sum, segment, num_segments=b + 1)[:b]
        unit_tokens = jax.ops.segment_sum(row_tokens, segment, num_segments=b + 1)[:b]
        rows_per_seq = jax.ops.segment_sum(jnp.ones_like(row_sum), segment, num_segments=b + 1)
        present = jnp.sum(rows_per_seq[:b] > 0)
    units = jnp.maximum(present if num_sequences is None else num_sequences, 1)
    tokens = jnp.maximum(row_tokens.sum() if num_tokens is None else num_tokens, 1)

    sums = UnitSums(
        row_sum, row_tokens, unit_sum, unit_tokens, units, tokens, num_micro_batches, fixed_length
    )
    loss = AGGREGATIONS[cfg.aggregation_name](sums)

    metrics = {
        "clip_low_fraction": _masked_mean(terms.clipped_low.astype(jnp.float32), mask),
        "clip_high_fraction": _masked_mean(terms.clipped_high.astype(jnp.float32), mask),
        "ratio_mean": _masked_mean(terms.ratio, mask),
        "kl_mean": _masked_mean(kl, mask),
        "tokens": row_tokens.sum(),
        # completion tokens in rows the off-policy mask dropped
        "off_policy_masked_fraction": _masked_mean(jnp.broadcast_to(~kept, mask.shape), mask),
        # the sampler-mismatch weight over completion tokens, and the share it zeroed
        "sampler_weight_mean": _masked_mean(is_weight, mask),
        "sampler_weight_zero_fraction": _masked_mean((is_weight == 0).astype(jnp.float32), mask),
    }
    return loss, metrics
