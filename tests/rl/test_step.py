import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmgrpo_jax.rl.advantages import advantages_for_groups
from mmgrpo_jax.rl.grouping import module_level_groups, trajectory_level_groups
from mmgrpo_jax.rl.losses import LossConfig, policy_loss
from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.rl.step import (
    Row,
    TrainState,
    make_logprob_fn,
    make_train_step,
    pack_rows,
    rows_from_groups,
    split_for_training,
    token_logprobs,
)
from models.config import ModelConfig
from models.decoder import Decoder
from models.lora import LoRAConfig
from programs import synthetic
from tests.models.test_lora import perturb

CFG = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, 1e-5, 1e4)
TEMPERATURE = 0.8


def make_rows(seed=0, n=7, trajectories=None):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(0, 64, rng.integers(3, 9)).tolist()
        completion = rng.integers(0, 64, rng.integers(1, 7)).tolist()
        tid = -1 if trajectories is None else trajectories[i]
        rows.append(Row(tuple(prompt), tuple(completion), float(rng.normal()), tid))
    return rows


def fresh_model():
    return perturb(Decoder(CFG, lora=LoRAConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(0)), scale=0.1)


def test_pack_rows_masks_completion_targets_only():
    rows = make_rows()
    batch = pack_rows(rows, micro_batch_size=3)
    assert batch.tokens.shape == (3, 3, 16) and batch.loss_mask.shape == (3, 3, 15)
    for k, row in enumerate(rows):
        m, i = divmod(k, 3)
        p, c = len(row.prompt_ids), len(row.completion_ids)
        assert np.asarray(batch.tokens[m, i, : p + c]).tolist() == list(
            row.prompt_ids + row.completion_ids
        )
        # the logits at position t score token t + 1: completion tokens are targets p .. p+c-1
        assert np.flatnonzero(np.asarray(batch.loss_mask[m, i])).tolist() == list(
            range(p - 1, p + c - 1)
        )
    assert not np.asarray(batch.valid[2, 1:]).any()  # padding rows are empty
    assert float(batch.num_sequences) == 7
    assert float(batch.num_tokens) == sum(len(r.completion_ids) for r in rows)


def test_pack_rows_keeps_trajectories_whole():
    rows = make_rows(trajectories=[5, 5, 9, 9, 9, 2, 7])
    batch = pack_rows(rows, micro_batch_size=4, trajectory_level=True)
    ids = np.asarray(batch.trajectory_ids).tolist()
    assert ids == [[0, 0, -1, -1], [0, 0, 0, 1], [0, -1, -1, -1]]
    assert float(batch.num_sequences) == 4
    with pytest.raises(ValueError, match="trajectory 9 has 3 rows, more than micro_batch_size=2"):
        pack_rows(rows, micro_batch_size=2, trajectory_level=True)
    with pytest.raises(ValueError, match="trajectory ids >= 0"):
        pack_rows(make_rows(), micro_batch_size=2, trajectory_level=True)


@nnx.jit
def full_batch_logps(model, tokens, valid):
    return token_logprobs(model, tokens, valid, TEMPERATURE)


def reference_loss(cfg, trainable, graphdef, frozen, rows, trajectory_level):
    """One micro-batch holding every row, with the default (in-batch) normalisers."""
    one = pack_rows(rows, micro_batch_size=len(rows), trajectory_level=trajectory_level)
    model = nnx.merge(graphdef, trainable, frozen)
    logps = token_logprobs(model, one.tokens[0], one.valid[0], TEMPERATURE)
    ref = token_logprobs(model, one.tokens[0], one.valid[0], TEMPERATURE, use_lora=False)
    loss, _ = policy_loss(
        cfg,
        logps,
        jax.lax.stop_gradient(logps),
        one.advantages[0],
        one.loss_mask[0],
        ref_logps=ref if cfg.beta > 0 else None,
        trajectory_ids=one.trajectory_ids[0] if trajectory_level else None,
    )
    return loss


CASES = [
    (LossConfig("grpo", beta=0.04), False),
    (LossConfig("dapo", epsilon_high=0.28), False),
    (LossConfig("dr_grpo", max_completion_length=8), False),
    (LossConfig("cispo", epsilon_high=5.0), False),
    (LossConfig("gspo"), False),
    (LossConfig("grpo"), True),
    (LossConfig("dapo"), True),
]


@pytest.mark.parametrize(
    ("cfg", "trajectory_level"), CASES, ids=lambda c: str(getattr(c, "variant", c))
)
def test_step_equals_the_losses_module_and_updates_lora_only(cfg, trajectory_level):
    tids = [0, 0, 1, 2, 2, 2, 3] if trajectory_level else None
    rows = make_rows(seed=3, trajectories=tids)
    model = fresh_model()
    base_before = jax.tree.map(
        np.asarray, nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    )
    optimizer = optax.sgd(1.0)  # new = old - grad, so the update is the gradient itself
    graphdef, state, frozen = split_for_training(model, optimizer)
    trainable = jax.tree.map(jnp.copy, state.trainable)
    want_loss, want_grad = jax.value_and_grad(reference_loss, argnums=1)(
        cfg, trainable, graphdef, frozen, rows, trajectory_level
    )
    step = make_train_step(graphdef, optimizer, cfg, TEMPERATURE, trajectory_level)
    new_state, metrics = step(
        state, frozen, pack_rows(rows, micro_batch_size=3, trajectory_level=trajectory_level)
    )
    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5, atol=1e-6)
    got_grad = jax.tree.map(lambda old, new: old - new, trainable, new_state.trainable)
    for (path, g), (_, w) in zip(
        nnx.to_flat_state(got_grad), nnx.to_flat_state(want_grad), strict=True
    ):
        np.testing.assert_allclose(
            g.get_value(), w.get_value(), rtol=1e-4, atol=1e-6, err_msg=str(path)
        )
    assert float(metrics["grad_norm"]) > 0
    updated = nnx.merge(graphdef, new_state.trainable, frozen)
    base_after = nnx.state(updated, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, base_before, jax.tree.map(np.asarray, base_after))


def test_prompt_positions_get_no_gradient():
    rows = make_rows(seed=5)
    batch = pack_rows(rows, micro_batch_size=len(rows))
    cfg = LossConfig("grpo")

    def loss_of(logps):
        return policy_loss(
            cfg, logps, jax.lax.stop_gradient(logps), batch.advantages[0], batch.loss_mask[0]
        )[0]

    model = fresh_model()
    logps = full_batch_logps(model, batch.tokens[0], batch.valid[0])
    grad = np.asarray(jax.grad(loss_of)(logps))
    mask = np.asarray(batch.loss_mask[0])
    assert np.all(grad[~mask] == 0) and np.all(grad[mask] != 0)
    for i, row in enumerate(rows):  # the masked-in targets are exactly the completion tokens
        targets = np.asarray(batch.tokens[0, i, 1:])[mask[i]]
        assert targets.tolist() == list(row.completion_ids)


def test_full_mode_trains_every_parameter():
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    optimizer = optax.adam(1e-2)
    graphdef, state, frozen = split_for_training(model, optimizer, trainable=nnx.Param)
    before = jax.tree.map(np.asarray, state.trainable)
    step = make_train_step(graphdef, optimizer, LossConfig("dapo"), TEMPERATURE)
    new_state, _ = step(state, frozen, pack_rows(make_rows(seed=2), micro_batch_size=4))
    changed = jax.tree.map(
        lambda a, b: not np.array_equal(a, np.asarray(b)), before, new_state.trainable
    )
    assert all(jax.tree.leaves(changed))


def test_full_mode_kl_uses_the_frozen_reference_copy():
    """The k3 term against a frozen copy: zero at the copy, the numpy k3 mean once it moved."""
    rows = make_rows(seed=4)
    cfg = LossConfig("grpo", beta=0.5)
    model = Decoder(CFG, rngs=nnx.Rngs(2))
    optimizer = optax.sgd(0.0)
    graphdef, state, frozen = split_for_training(model, optimizer, trainable=nnx.Param)
    reference = jax.tree.map(jnp.copy, state.trainable)
    batch = pack_rows(rows, micro_batch_size=len(rows))
    step = make_train_step(graphdef, optimizer, cfg, TEMPERATURE)
    state, metrics = step(state, frozen, batch, reference)
    assert abs(float(metrics["kl_mean"])) < 1e-6
    moved = jax.tree.map(lambda x: x * 1.3, reference)
    want_policy = nnx.merge(graphdef, moved, frozen)
    want_ref = nnx.merge(graphdef, reference, frozen)
    logp = np.asarray(full_batch_logps(want_policy, batch.tokens[0], batch.valid[0]))
    ref = np.asarray(full_batch_logps(want_ref, batch.tokens[0], batch.valid[0]))
    mask = np.asarray(batch.loss_mask[0])
    k3 = np.exp(ref - logp) - (ref - logp) - 1
    _, metrics = step(TrainState(moved, state.opt_state), frozen, batch, reference)
    assert float(metrics["kl_mean"]) > 1e-3
    np.testing.assert_allclose(float(metrics["kl_mean"]), k3[mask].mean(), rtol=1e-4)


def test_rows_and_steps_reject_bad_input():
    with pytest.raises(ValueError, match="at least one prompt token"):
        Row((), (1,), 0.0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        pack_rows(make_rows(), micro_batch_size=0)
    with pytest.raises(ValueError, match="no rows"):
        pack_rows([], micro_batch_size=2)
    graphdef, _, _ = split_for_training(fresh_model(), optax.sgd(1.0))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        make_train_step(graphdef, optax.sgd(1.0), LossConfig("grpo"), 0.0)


def synthetic_groups(trajectory_level):
    table = synthetic.LinkTable.make(4, seed=0)
    program = synthetic.LinkFollower(table, max_links=2)
    examples = synthetic.make_examples(table, 2, max_links=2, seed=0)
    lm = synthetic.noisy_policy(program, accuracy=0.6, format_error_rate=0.1, seed=2)
    trajectories = run_rollouts(program, examples, synthetic.metric, num_rollouts=4, lm=lm)
    groups = (trajectory_level_groups if trajectory_level else module_level_groups)(trajectories)
    return trajectories, groups, advantages_for_groups(groups)


@pytest.mark.parametrize("trajectory_level", [False, True])
def test_rows_from_groups_carry_the_sampled_ids_and_advantages(trajectory_level):
    trajectories, groups, advantages = synthetic_groups(trajectory_level)
    rows = rows_from_groups(groups, advantages, trajectory_level=trajectory_level)
    expected = [
        (call, float(a), k if trajectory_level else -1)
        for k, (member, a) in enumerate(
            (m, a)
            for g, adv in zip(groups, advantages, strict=True)
            for m, a in zip(g.members, adv, strict=True)
        )
        for call in member.calls
    ]
    assert len(rows) == len(expected)
    for row, (call, advantage, tid) in zip(rows, expected, strict=True):
        assert row.prompt_ids == call.prompt_ids and row.completion_ids == call.completion_ids
        assert row.advantage == advantage and row.trajectory_id == tid
        assert row.sampler_logprobs == call.logprobs and row.in_loss
    if trajectory_level:
        assert len(rows) == sum(len(t.calls) for t in trajectories)


def test_truncated_completions_can_be_masked_and_missing_ids_are_an_error():
    _, groups, advantages = synthetic_groups(False)
    member = groups[0].members[0]
    truncated_call = dataclasses.replace(member.calls[0], finish_reason="length")
    groups[0] = dataclasses.replace(
        groups[0],
        members=(dataclasses.replace(member, calls=(truncated_call,)), *groups[0].members[1:]),
    )
    rows = rows_from_groups(groups, advantages, mask_truncated_completions=True)
    assert not rows[0].in_loss and all(r.in_loss for r in rows[1:])
    batch = pack_rows(rows, micro_batch_size=len(rows))
    assert not np.asarray(batch.loss_mask[0, 0]).any()
    assert float(batch.num_tokens) == sum(len(r.completion_ids) for r in rows[1:])
    no_ids = dataclasses.replace(truncated_call, completion_ids=None)
    groups[0] = dataclasses.replace(
        groups[0], members=(dataclasses.replace(member, calls=(no_ids,)), *groups[0].members[1:])
    )
    with pytest.raises(ValueError, match=r"start\[0\] has no token ids"):
        rows_from_groups(groups, advantages)


@pytest.mark.parametrize("trajectory_level", [False, True])
def test_a_step_on_synthetic_rollouts_moves_the_lora_parameters(trajectory_level):
    _, groups, advantages = synthetic_groups(trajectory_level)
    rows = rows_from_groups(groups, advantages, trajectory_level=trajectory_level)
    model = Decoder(  # byte-level ids from the scripted LM: vocabulary 256
        ModelConfig("llama", 256, 32, 64, 1, 4, 2, 8, 1e-5, 1e4),
        lora=LoRAConfig(rank=2, alpha=4.0),
        rngs=nnx.Rngs(0),
    )
    optimizer = optax.adamw(1e-3)
    graphdef, state, frozen = split_for_training(model, optimizer)
    before = jax.tree.map(np.asarray, state.trainable)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), 1.0, trajectory_level)
    micro = 64 if trajectory_level else 16
    state, metrics = step(state, frozen, pack_rows(rows, micro, trajectory_level=trajectory_level))
    assert np.isfinite(float(metrics["loss"])) and float(metrics["tokens"]) > 0
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    moved = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before, state.trainable)
    assert any(jax.tree.leaves(moved))


def test_old_logprobs_drive_the_ratio_across_iterations():
    rows = make_rows(seed=8)
    model = fresh_model()
    optimizer = optax.adam(5e-2)
    graphdef, state, frozen = split_for_training(model, optimizer)
    batch = pack_rows(rows, micro_batch_size=4)
    old = make_logprob_fn(graphdef, TEMPERATURE)(state.trainable, frozen, batch)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), TEMPERATURE)
    with_old = batch.replace(old_logps=old)
    state, first = step(state, frozen, with_old)
    assert float(first["ratio_mean"]) == pytest.approx(1.0, abs=1e-6)  # same weights: rho = 1
    state, second = step(state, frozen, with_old)
    assert abs(float(second["ratio_mean"]) - 1.0) > 1e-4  # the policy moved away from old
    # the frozen base weights were not donated: the model still runs on them
    assert np.isfinite(
        np.asarray(nnx.merge(graphdef, state.trainable, frozen)(batch.tokens[0]))
    ).all()
