"""The jitted policy update and the log-prob pass, as pure functions of named state
(docs/design.md#architecture).

One jitted step scans the `Batch`'s micro-batches, accumulates gradients of the trainable
parameters (LoRA, or everything for tiny from-scratch models) and applies one optax update.
`TrainState` is what an update changes and is donated; `FrozenWeights` (the rest of the model and,
for "full" training with a KL term, a frozen copy of the starting weights) sits beside it and is
never donated. LoRA dropout draws from `TrainState.key`, split once per step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mmgrpo_jax.rl.batch import Batch
from mmgrpo_jax.rl.losses import LossConfig, policy_loss, sampler_log_weight
from models.decoder import Decoder
from models.lora import UseLoRA
from models.sharding import replicated


@flax.struct.dataclass
class TrainState:
    """What an update changes (donated into the step)."""

    trainable: nnx.State  # LoRA parameters (or every parameter in "full" mode)
    opt_state: optax.OptState
    key: jax.Array  # raw uint32 PRNG key data: the LoRA dropout stream


@flax.struct.dataclass
class FrozenWeights:
    """What an update reads and never changes (not donated)."""

    base: nnx.State  # every model variable that is not trained
    reference: nnx.State | None = None  # KL reference for "full" training: the starting weights


TrainStep = Callable[[TrainState, FrozenWeights, Batch], tuple[TrainState, dict[str, jax.Array]]]


def split_for_training(
    model: Decoder,
    optimizer: optax.GradientTransformation,
    trainable: Any = nnx.LoRAParam,
    *,
    seed: int = 0,
    frozen_reference: bool = False,
) -> tuple[nnx.GraphDef, TrainState, FrozenWeights]:
    """Split once, outside the jit: graphdef, the donated state, and the frozen rest.

    `frozen_reference` keeps a copy of the starting trainable weights as the KL reference (for
    "full" training, which has no LoRA-off base to compare with).
    """
    graphdef, params, base = nnx.split(model, trainable, ...)
    # The step donates the trainable buffers: copy them, so the model (and any engine split
    # from it) keeps arrays that stay alive. LoRA parameters are small.
    params = jax.tree.map(jnp.copy, params)
    reference = jax.tree.map(jnp.copy, params) if frozen_reference else None
    key = jax.random.key_data(jax.random.key(seed))
    state = TrainState(params, optimizer.init(params), key)
    return graphdef, state, FrozenWeights(base, reference)


def token_logprobs(
    model: Decoder,
    tokens: jax.Array,  # [b, L]
    valid: jax.Array,  # [b, L]
    temperature: float,
    use_lora: UseLoRA = True,
    rngs: nnx.Rngs | None = None,
    *,
    logits_chunk: int = 0,
    positions: jax.Array | None = None,  # [b, L] packed rows: restarting per row
    segments: jax.Array | None = None,  # [b, L] packed rows: which row each token is of
) -> jax.Array:  # [b, L-1] log p(token t+1 | tokens <= t)
    """Log-probs of the next tokens under logits / temperature, the sampler's distribution."""
    hidden = model.final_hidden(tokens, valid, positions, segments, use_lora, rngs)[:, :-1]
    return target_logprobs(model, hidden, tokens[:, 1:], temperature, logits_chunk)


def batch_logprobs(
    model: Decoder,
    micro: Batch,
    temperature: float,
    use_lora: bool = True,
    rngs: nnx.Rngs | None = None,
    logits_chunk: int = 0,
) -> jax.Array:  # [b, L-1] in the micro-batch's row layout, packed or not
    """A micro-batch's target log-probs in its rows' layout, packed or not. Only the completion
    targets (`Batch.target_index`) go through the lm_head; the rest stay 0 (no loss reads them).
    `use_lora=True` runs each row on its own adapter (`Batch.use_lora`), False on the base."""
    lora = micro.use_lora if use_lora else False
    if micro.target_index is None:  # the reference: every position of unpacked rows
        if micro.positions is not None:
            raise ValueError("packed rows need Batch.target_index (pack_rows fills it)")
        return token_logprobs(
            model, micro.tokens, micro.valid, temperature, lora, rngs, logits_chunk=logits_chunk
        )
    hidden = model.final_hidden(
        micro.tokens, micro.valid, micro.positions, micro.segments, lora, rngs, micro.reach
    )
    # each sequence's targets are its own positions: the gather stays within a sequence
    at = jnp.take_along_axis(hidden, micro.target_index[..., None], axis=1)
    logps = target_logprobs(model, at, micro.target_tokens, temperature, logits_chunk)
    rows, targets = micro.loss_mask.shape
    row = jnp.arange(rows)[:, None] if micro.target_row is None else micro.target_row
    placed = jnp.zeros((rows, targets), logps.dtype)
    return placed.at[row, micro.target_slot].set(logps, mode="drop")


def target_logprobs(
    model: Decoder,
    hidden: jax.Array,  # [b, n, D] final hidden states
    targets: jax.Array,  # [b, n]
    temperature: float,
    chunk: int = 0,
) -> jax.Array:  # [b, n]
    """log softmax(lm_head(hidden) / T) at the targets.

    With `chunk` > 0 the lm_head runs on `chunk` positions at a time under rematerialisation, so
    neither the forward nor the backward pass ever holds [b, n, V] float32 logits (40 GB at
    8 x 8,192 positions and Qwen3's 151,936 words); 0 computes them at once (the reference).
    """

    def chosen_logprobs(h: jax.Array, t: jax.Array) -> jax.Array:
        logits = model.logits(h).astype(jnp.float32) / temperature
        chosen = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return chosen - jax.nn.logsumexp(logits, axis=-1)

    b, n, d = hidden.shape
    if chunk <= 0 or chunk >= n:
        return chosen_logprobs(hidden, targets)
    pad = -n % chunk
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, -1, chunk, d)
    targets = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, -1, chunk)

    @jax.checkpoint
    def one(_, h_and_t):
        return None, chosen_logprobs(*h_and_t)

    _, out = jax.lax.scan(one, None, (hidden.swapaxes(0, 1), targets.swapaxes(0, 1)))
    return out.swapaxes(0, 1).reshape(b, -1)[:, :n]


def make_logprob_fn(
    graphdef: nnx.GraphDef, temperature: float, logits_chunk: int = 0
) -> Callable[[nnx.State, FrozenWeights, Batch], jax.Array]:
    """Jitted per-token log-probs of a packed batch, [A, b, L-1]: the old log-probs of a step."""

    @jax.jit
    def logprobs(trainable: nnx.State, frozen: FrozenWeights, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, trainable, frozen.base)

        def one(_, micro: Batch):
            return None, batch_logprobs(model, micro, temperature, logits_chunk=logits_chunk)

        return jax.lax.scan(one, None, batch)[1]

    return logprobs


def _sampler_gap(logps: jax.Array, micro: Batch) -> tuple[jax.Array, jax.Array]:
    """Sum and count of |trainer - sampler| log-prob over completion tokens with sampler values."""
    where = micro.loss_mask & micro.has_sampler_logps[:, None]
    gap = jnp.where(where, jnp.abs(logps - micro.sampler_logps), 0.0)
    return gap.sum(), where.sum().astype(jnp.float32)


ROW_METRIC = "row/"  # step metrics kept per row ([A, b]), not averaged: per-module summaries
ROW_SAMPLER_KEYS = tuple(
    f"{ROW_METRIC}{name}" for name in ("sampler_weight_sum", "sampler_weight_zeros", "tokens")
)


def _row_sampler_weights(
    cfg: LossConfig, old: jax.Array, behaviour: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    """Each row's sum of the sampler-mismatch weight over its completion tokens, and how many
    of them it zeroed: what the trainer sums per module (`sampler_weight_mean/<module>`)."""
    behaviour = jnp.where(mask, behaviour, 0.0)
    weight = jnp.broadcast_to(jnp.exp(sampler_log_weight(cfg, old, behaviour, mask)), mask.shape)
    weight = jax.lax.stop_gradient(weight)
    return {
        f"{ROW_METRIC}sampler_weight_sum": jnp.where(mask, weight, 0.0).sum(-1),
        f"{ROW_METRIC}sampler_weight_zeros": (mask & (weight == 0)).sum(-1).astype(jnp.float32),
        f"{ROW_METRIC}tokens": mask.sum(-1).astype(jnp.float32),
    }


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_cfg: LossConfig,
    temperature: float,
    logits_chunk: int = 0,
    state_sharding: TrainState | None = None,
) -> TrainStep:
    """A jitted (state, frozen, batch) -> (state, metrics); the state's buffers are donated.

    On a mesh, `state_sharding` (the shardings of the state passed in) is where the new state
    stays, step after step, and the metrics come back replicated; the batch's placement decides
    how rows split (see mmgrpo_jax.parallel).
    Gradients of the micro-batches are summed (their losses carry the whole step's normalisers)
    and applied once. With beta > 0 the reference log-probs come from `frozen.reference` when
    set, else from the same weights with LoRA off. Old log-probs are `batch.old_logps` when given
    (several updates per rollout batch), else the current ones under stop_gradient. The metric
    `sampler_logprob_gap` compares the trainer's log-probs (before this update) with the sampler's.
    `logits_chunk` > 0 computes the log-probs in chunks of positions (see `target_logprobs`).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for training log-probs, got {temperature}")

    def micro_loss(trainable, frozen: FrozenWeights, micro: Batch, count: int, key: jax.Array):
        model = nnx.merge(graphdef, trainable, frozen.base)
        rngs = nnx.Rngs(dropout=key)  # used only by LoRA layers with dropout > 0
        logprobs = functools.partial(
            batch_logprobs, micro=micro, temperature=temperature, logits_chunk=logits_chunk
        )
        logps = logprobs(model, rngs=rngs)
        ref = None
        if loss_cfg.beta > 0 and frozen.reference is None:
            ref = jax.lax.stop_gradient(logprobs(model, use_lora=False))
        elif loss_cfg.beta > 0:
            ref_model = nnx.merge(graphdef, frozen.reference, frozen.base)
            ref = jax.lax.stop_gradient(logprobs(ref_model))
        old = jax.lax.stop_gradient(logps) if micro.old_logps is None else micro.old_logps
        # what the tokens were sampled with: the sampler's log-probs where the LM returned them
        behaviour = jnp.where(micro.has_sampler_logps[:, None], micro.sampler_logps, old)
        loss, metrics = policy_loss(
            loss_cfg, logps, old, micro, ref_logps=ref, sampler_logps=behaviour,
            num_micro_batches=count,
        )  # fmt: skip
        gap_sum, gap_tokens = _sampler_gap(jax.lax.stop_gradient(logps), micro)
        metrics = {**metrics, "gap_sum": gap_sum, "gap_tokens": gap_tokens}
        if loss_cfg.sampler_correction is not None:
            metrics.update(_row_sampler_weights(loss_cfg, old, behaviour, micro.loss_mask))
        return loss, metrics

    def step(
        state: TrainState, frozen: FrozenWeights, batch: Batch
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        count = batch.tokens.shape[0]
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        next_key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))

        def accumulate(grads, micro_and_index):
            micro, index = micro_and_index
            key = jax.random.fold_in(step_key, index)
            (loss, metrics), g = grad_fn(state.trainable, frozen, micro, count, key)
            return jax.tree.map(jnp.add, grads, g), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, state.trainable)
        micro_batches = (batch, jnp.arange(count))
        grads, (losses, metrics) = jax.lax.scan(accumulate, zeros, micro_batches)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        grad_norm = optax.tree.norm(grads)
        # a non-finite loss, gradient or result is never applied: the old state is kept
        finite = _all_finite((trainable, opt_state))
        applied = jnp.isfinite(losses.sum()) & jnp.isfinite(grad_norm) & finite
        trainable, opt_state = jax.tree.map(
            lambda new, old: jnp.where(applied, new, old),
            (trainable, opt_state),
            (state.trainable, state.opt_state),
        )
        tokens = metrics.pop("tokens")
        gap_sum, gap_tokens = metrics.pop("gap_sum").sum(), metrics.pop("gap_tokens").sum()
        per_row = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(ROW_METRIC)]}
        # token-weighted means over micro-batches, so they equal the whole step's means
        summary = {
            k: jnp.sum(v * tokens) / jnp.maximum(tokens.sum(), 1) for k, v in metrics.items()
        }
        summary.update(
            tokens=tokens.sum(),
            loss=losses.sum(),
            grad_norm=grad_norm,
            update_applied=applied,
            sampler_logprob_gap=jnp.where(gap_tokens > 0, gap_sum / gap_tokens, jnp.nan),
            **per_row,  # [A, b] in the batch's row layout
        )
        new_state = TrainState(trainable, opt_state, jax.random.key_data(next_key))
        return new_state, summary

    if state_sharding is None:
        return jax.jit(step, donate_argnums=0)
    metrics_sharding = replicated(jax.tree.leaves(state_sharding)[0].mesh)
    return jax.jit(step, donate_argnums=0, out_shardings=(state_sharding, metrics_sharding))


def make_idle_step(
    optimizer: optax.GradientTransformation, state_sharding: TrainState | None = None
) -> Callable[[TrainState], TrainState]:
    """The train step's new state when every gradient is zero, without its forward and backward.

    With every advantage 0 and no KL term (beta = 0) each loss variant is 0 at every token and
    so is its gradient; the step would still apply the optimizer to zeros (Adam's momentum and
    weight decay move the weights, the schedule counts) and advance the dropout key. This does
    exactly that and nothing else: on a 135M model it is milliseconds, not the tens of seconds a
    pass over the rows costs on a CPU.
    """

    def idle(state: TrainState) -> TrainState:
        zeros = jax.tree.map(jnp.zeros_like, state.trainable)
        updates, opt_state = optimizer.update(zeros, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        next_key, _ = jax.random.split(jax.random.wrap_key_data(state.key))
        return TrainState(trainable, opt_state, jax.random.key_data(next_key))

    return jax.jit(idle, donate_argnums=0, out_shardings=state_sharding)


def gradient_is_zero(advantages: Any, loss_cfg: LossConfig) -> bool:
    """Whether a batch's gradient is zero before any pass: no advantage and no KL term."""
    return loss_cfg.beta == 0 and not np.any(np.asarray(advantages))


def _all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf is finite (optimizer step counters are integers)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
