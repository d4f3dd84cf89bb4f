"""Training rows, padded micro-batches and the jitted policy update (DESIGN sections 3-4).

A row is one (prompt, completion) pair from a trace: the exact sampled token ids, never text
re-rendered from parsed fields. Rows are right-padded into [M, b, L] micro-batches whose length L
is bucketed; the loss mask covers completion targets only. One jitted step scans the micro-batches,
accumulates gradients of the trainable parameters (LoRA, or everything for tiny from-scratch
models), and applies one optax update. Shapes: M micro-batches, b rows each, L tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mmgrpo_jax.rl.grouping import Group
from mmgrpo_jax.rl.losses import LossConfig, policy_loss
from mmgrpo_jax.sampling import MIN_LENGTH_BUCKET
from mmgrpo_jax.shapes import bucket
from models.decoder import Decoder


@dataclasses.dataclass(frozen=True)
class Row:
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    advantage: float
    trajectory_id: int = -1  # trajectory-level grouping: rows of one trajectory share an id
    sampler_logprobs: tuple[float, ...] | None = None
    in_loss: bool = True  # False: a truncated completion kept only as a fully masked row

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a training row needs at least one prompt token")


def rows_from_groups(
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    *,
    trajectory_level: bool = False,
    mask_truncated_completions: bool = False,
) -> list[Row]:
    """One row per (member, call): the exact sampled ids, the member's advantage.

    At trajectory level every group member is one trajectory unit with its own id, so a member
    that padding or select-K repeated counts twice, as TRL trains a repeated completion twice.
    """
    rows: list[Row] = []
    members = 0
    for group, group_advantages in zip(groups, advantages, strict=True):
        for member, advantage in zip(group.members, group_advantages, strict=True):
            tid = members if trajectory_level else -1
            members += 1
            for call in member.calls:
                if call.prompt_ids is None or call.completion_ids is None:
                    raise ValueError(
                        f"call {call.predictor}[{call.invocation}] has no token ids; train with an "
                        "LM that returns them (JaxLM)"
                    )
                if not call.completion_ids:
                    continue  # nothing was generated: no token to train
                truncated = call.finish_reason == "length"
                rows.append(
                    Row(
                        call.prompt_ids,
                        call.completion_ids,
                        float(advantage),
                        tid,
                        call.logprobs,
                        in_loss=not (mask_truncated_completions and truncated),
                    )
                )
    return rows


@flax.struct.dataclass
class Batch:
    tokens: jax.Array  # [M, b, L]
    valid: jax.Array  # [M, b, L] real tokens (prompt and completion)
    loss_mask: jax.Array  # [M, b, L-1] targets that are completion tokens
    advantages: jax.Array  # [M, b]
    trajectory_ids: jax.Array  # [M, b], -1 when rows are their own sequences
    num_sequences: jax.Array  # [] rows (or trajectories) in the whole step
    num_tokens: jax.Array  # [] completion tokens in the whole step
    old_logps: jax.Array | None = None  # [M, b, L-1] before the step's first update


def micro_batch_layout(
    rows: Sequence[Row], micro_batch_size: int, trajectory_level: bool = False
) -> list[list[int]]:
    """Row indices of each micro-batch.

    At trajectory level a trajectory's rows must share a micro-batch (the loss normalises by the
    trajectory's total tokens), so rows are laid out trajectory by trajectory and a micro-batch
    is closed before a trajectory that would not fit; a trajectory larger than the micro-batch
    is an error.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if not rows:
        raise ValueError("no rows to pack")
    if not trajectory_level:
        return [
            list(range(i, min(i + micro_batch_size, len(rows))))
            for i in range(0, len(rows), micro_batch_size)
        ]
    by_trajectory: dict[int, list[int]] = {}
    for k, row in enumerate(rows):
        if row.trajectory_id < 0:
            raise ValueError(f"trajectory-level rows need trajectory ids >= 0, got {row}")
        by_trajectory.setdefault(row.trajectory_id, []).append(k)
    chunks: list[list[int]] = [[]]
    for tid, group in by_trajectory.items():
        if len(group) > micro_batch_size:
            raise ValueError(
                f"trajectory {tid} has {len(group)} rows, more than micro_batch_size="
                f"{micro_batch_size}; raise it"
            )
        if len(chunks[-1]) + len(group) > micro_batch_size:
            chunks.append([])
        chunks[-1] += group
    return chunks


def pack_rows(
    rows: Sequence[Row], micro_batch_size: int, *, trajectory_level: bool = False
) -> Batch:
    """Right-padded micro-batches laid out by `micro_batch_layout`; trajectory ids renumbered."""
    chunks = [
        [rows[k] for k in chunk]
        for chunk in micro_batch_layout(rows, micro_batch_size, trajectory_level)
    ]
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    length = bucket(longest, MIN_LENGTH_BUCKET)
    shape = (len(chunks), micro_batch_size)
    tokens = np.zeros((*shape, length), np.int32)
    valid = np.zeros((*shape, length), bool)
    loss_mask = np.zeros((*shape, length - 1), bool)
    advantages = np.zeros(shape, np.float32)
    trajectory_ids = np.full(shape, -1, np.int32)
    for m, chunk in enumerate(chunks):
        local_ids: dict[int, int] = {}
        for i, row in enumerate(chunk):
            p, c = len(row.prompt_ids), len(row.completion_ids)
            tokens[m, i, : p + c] = row.prompt_ids + row.completion_ids
            valid[m, i, : p + c] = True
            loss_mask[m, i, p - 1 : p + c - 1] = row.in_loss  # logits at t predict token t + 1
            advantages[m, i] = row.advantage
            if trajectory_level:
                trajectory_ids[m, i] = local_ids.setdefault(row.trajectory_id, len(local_ids))
    sequences = len({r.trajectory_id for r in rows}) if trajectory_level else len(rows)
    return Batch(
        tokens=jnp.asarray(tokens),
        valid=jnp.asarray(valid),
        loss_mask=jnp.asarray(loss_mask),
        advantages=jnp.asarray(advantages),
        trajectory_ids=jnp.asarray(trajectory_ids),
        num_sequences=jnp.asarray(sequences, jnp.float32),
        num_tokens=jnp.asarray(sum(len(r.completion_ids) for r in rows if r.in_loss), jnp.float32),
    )


def token_logprobs(
    model: Decoder,
    tokens: jax.Array,  # [b, L]
    valid: jax.Array,  # [b, L]
    temperature: float,
    use_lora: bool = True,
) -> jax.Array:  # [b, L-1] log p(token t+1 | tokens <= t)
    """Log-probs of the next tokens under logits / temperature, the sampler's distribution."""
    logits = model(tokens, attention_mask=valid, use_lora=use_lora)[:, :-1].astype(jnp.float32)
    logits = logits / temperature
    targets = tokens[:, 1:]
    chosen = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return chosen - jax.nn.logsumexp(logits, axis=-1)


@flax.struct.dataclass
class TrainState:
    """What an update changes; the frozen rest of the model is passed beside it, not donated."""

    trainable: nnx.State  # LoRA parameters (or every parameter in "full" mode)
    opt_state: optax.OptState


TrainStep = Callable[..., tuple[TrainState, dict[str, jax.Array]]]


def split_for_training(
    model: Decoder, optimizer: optax.GradientTransformation, trainable: Any = nnx.LoRAParam
) -> tuple[nnx.GraphDef, TrainState, nnx.State]:
    """Split once, outside the jit: graphdef, trainable state + optimizer state, frozen rest."""
    graphdef, params, frozen = nnx.split(model, trainable, ...)
    return graphdef, TrainState(params, optimizer.init(params)), frozen


def _micro_batches(batch: Batch) -> tuple[jax.Array, ...]:
    old = () if batch.old_logps is None else (batch.old_logps,)
    return (
        batch.tokens,
        batch.valid,
        batch.loss_mask,
        batch.advantages,
        batch.trajectory_ids,
        *old,
    )


def make_logprob_fn(
    graphdef: nnx.GraphDef, temperature: float
) -> Callable[[nnx.State, nnx.State, Batch], jax.Array]:
    """Jitted per-token log-probs of a packed batch, [M, b, L-1]: the old log-probs of a step."""

    @jax.jit
    def logprobs(trainable: nnx.State, frozen: nnx.State, batch: Batch) -> jax.Array:
        model = nnx.merge(graphdef, trainable, frozen)

        def one(_, micro):
            return None, token_logprobs(model, micro[0], micro[1], temperature)

        return jax.lax.scan(one, None, (batch.tokens, batch.valid))[1]

    return logprobs


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    loss_cfg: LossConfig,
    temperature: float,
    trajectory_level: bool = False,
) -> TrainStep:
    """A jitted (state, frozen, batch) -> (state, metrics); the state's buffers are donated.

    Gradients of the micro-batches are summed (their losses carry the whole step's normalisers)
    and applied once. With beta > 0 the reference log-probs come from `reference` (a frozen copy of
    the trainable state, for "full" training) or else from the same weights with LoRA off. Old
    log-probs are `batch.old_logps` when given (several updates per rollout batch), else
    the current ones under stop_gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for training log-probs, got {temperature}")

    def micro_loss(trainable, frozen, micro, batch, count, reference):
        tokens, valid, loss_mask, advantages, trajectory_ids, *old = micro
        model = nnx.merge(graphdef, trainable, frozen)
        logps = token_logprobs(model, tokens, valid, temperature)
        ref = None
        if loss_cfg.beta > 0 and reference is None:
            ref = token_logprobs(model, tokens, valid, temperature, use_lora=False)
        elif loss_cfg.beta > 0:
            ref_model = nnx.merge(graphdef, reference, frozen)
            ref = jax.lax.stop_gradient(token_logprobs(ref_model, tokens, valid, temperature))
        return policy_loss(
            loss_cfg,
            logps,
            old[0] if old else jax.lax.stop_gradient(logps),
            advantages,
            loss_mask,
            ref_logps=ref,
            trajectory_ids=trajectory_ids if trajectory_level else None,
            num_sequences=batch.num_sequences,
            num_tokens=batch.num_tokens,
            num_micro_batches=count,
        )

    @functools.partial(jax.jit, donate_argnums=0)
    def step(
        state: TrainState, frozen: nnx.State, batch: Batch, reference: nnx.State | None = None
    ) -> tuple[TrainState, dict[str, jax.Array]]:
        count = batch.tokens.shape[0]
        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def accumulate(grads, micro):
            (loss, metrics), g = grad_fn(state.trainable, frozen, micro, batch, count, reference)
            return jax.tree.map(jnp.add, grads, g), (loss, metrics)

        zeros = jax.tree.map(jnp.zeros_like, state.trainable)
        grads, (losses, metrics) = jax.lax.scan(accumulate, zeros, _micro_batches(batch))
        updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        tokens = metrics.pop("tokens")
        # token-weighted means over micro-batches, so they equal the whole step's means
        summary = {
            k: jnp.sum(v * tokens) / jnp.maximum(tokens.sum(), 1) for k, v in metrics.items()
        }
        summary.update(tokens=tokens.sum(), loss=losses.sum(), grad_norm=optax.tree.norm(grads))
        return TrainState(trainable, opt_state), summary

    return step
