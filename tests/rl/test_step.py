import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmgrpo_jax.rl.batch import PackShape, Row, batch_layout, pack_rows, rows_from_groups
from mmgrpo_jax.rl.losses import LossConfig, LossRows, policy_loss
from mmgrpo_jax.rl.step import (
    ROW_METRIC,
    ROW_SAMPLER_KEYS,
    make_logprob_fn,
    make_train_step,
    split_for_training,
    token_logprobs,
)
from mmgrpo_jax.testing import tiny_decoder
from models.attention import AttentionConfig
from models.config import ModelConfig
from models.decoder import Decoder
from models.lora import LoRAConfig
from tests.models.test_lora import perturb, single_adapter
from tests.rl.test_batch import make_rows, program_rows, synthetic_groups, unit

CFG = ModelConfig.tiny(64, num_layers=2)
TEMPERATURE = 0.8


def fresh_model(dropout=0.0):
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=dropout)
    return perturb(Decoder(CFG, lora=lora, rngs=nnx.Rngs(0)), scale=0.1)


@nnx.jit
def full_batch_logps(model, tokens, valid):
    return token_logprobs(model, tokens, valid, TEMPERATURE)


def reference_loss(cfg, trainable, graphdef, frozen, rows, trajectory_level):
    """One micro-batch holding every row, with the default (in-batch) normalisers."""
    one = pack_rows(rows, micro_batch_size=len(rows))
    model = nnx.merge(graphdef, trainable, frozen.base)
    logps = token_logprobs(model, one.tokens[0], one.valid[0], TEMPERATURE)
    ref = token_logprobs(model, one.tokens[0], one.valid[0], TEMPERATURE, use_lora=False)
    units = one.unit_ids[0] if trajectory_level else None
    rows = LossRows(one.advantages[0], one.loss_mask[0], units)
    ref = ref if cfg.beta > 0 else None
    loss, _ = policy_loss(cfg, logps, jax.lax.stop_gradient(logps), rows, ref_logps=ref)
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
    step = make_train_step(graphdef, optimizer, cfg, TEMPERATURE)
    new_state, metrics = step(state, frozen, pack_rows(rows, micro_batch_size=3))
    np.testing.assert_allclose(float(metrics["loss"]), float(want_loss), rtol=1e-5, atol=1e-6)
    got_grad = jax.tree.map(lambda old, new: old - new, trainable, new_state.trainable)
    for (path, g), (_, w) in zip(
        nnx.to_flat_state(got_grad), nnx.to_flat_state(want_grad), strict=True
    ):
        np.testing.assert_allclose(
            g.get_value(), w.get_value(), rtol=1e-4, atol=1e-6, err_msg=str(path)
        )
    assert float(metrics["grad_norm"]) > 0
    updated = nnx.merge(graphdef, new_state.trainable, frozen.base)
    base_after = nnx.state(updated, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, base_before, jax.tree.map(np.asarray, base_after))


def test_prompt_positions_get_no_gradient():
    rows = make_rows(seed=5)
    batch = pack_rows(rows, micro_batch_size=len(rows))
    cfg = LossConfig("grpo")

    def loss_of(logps):
        rows = LossRows(batch.advantages[0], batch.loss_mask[0])
        return policy_loss(cfg, logps, jax.lax.stop_gradient(logps), rows)[0]

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
    graphdef, state, frozen = split_for_training(
        model, optimizer, trainable=nnx.Param, frozen_reference=True
    )
    reference = frozen.reference
    batch = pack_rows(rows, micro_batch_size=len(rows))
    step = make_train_step(graphdef, optimizer, cfg, TEMPERATURE)
    state, metrics = step(state, frozen, batch)
    assert abs(float(metrics["kl_mean"])) < 1e-6
    moved = jax.tree.map(lambda x: x * 1.3, reference)
    want_policy = nnx.merge(graphdef, moved, frozen.base)
    want_ref = nnx.merge(graphdef, reference, frozen.base)
    logp = np.asarray(full_batch_logps(want_policy, batch.tokens[0], batch.valid[0]))
    ref = np.asarray(full_batch_logps(want_ref, batch.tokens[0], batch.valid[0]))
    mask = np.asarray(batch.loss_mask[0])
    k3 = np.exp(ref - logp) - (ref - logp) - 1
    _, metrics = step(state.replace(trainable=moved), frozen, batch)
    assert float(metrics["kl_mean"]) > 1e-3
    np.testing.assert_allclose(float(metrics["kl_mean"]), k3[mask].mean(), rtol=1e-4)


def test_steps_reject_bad_input():
    graphdef, _, _ = split_for_training(fresh_model(), optax.sgd(1.0))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        make_train_step(graphdef, optax.sgd(1.0), LossConfig("grpo"), 0.0)


@pytest.mark.parametrize("trajectory_level", [False, True])
def test_a_step_on_synthetic_rollouts_moves_the_lora_parameters(trajectory_level):
    _, groups, advantages = synthetic_groups(trajectory_level)
    rows = rows_from_groups(groups, advantages, unit=unit(trajectory_level))
    # byte-level ids from the scripted LM: vocabulary 256
    model = tiny_decoder(256, lora=LoRAConfig(rank=2, alpha=4.0))
    optimizer = optax.adamw(1e-3)
    graphdef, state, frozen = split_for_training(model, optimizer)
    before = jax.tree.map(np.asarray, state.trainable)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), 1.0)
    micro = 64 if trajectory_level else 16
    state, metrics = step(state, frozen, pack_rows(rows, micro))
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
        np.asarray(nnx.merge(graphdef, state.trainable, frozen.base)(batch.tokens[0]))
    ).all()


def gradient(model, rows, seed=0):
    """The step's gradient (sgd(1): old - new) and the state after it."""
    optimizer = optax.sgd(1.0)
    graphdef, state, frozen = split_for_training(model, optimizer, seed=seed)
    before = jax.tree.map(jnp.copy, state.trainable)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), TEMPERATURE)
    new_state, _ = step(state, frozen, pack_rows(rows, micro_batch_size=4))
    grad = jax.tree.map(lambda a, b: np.asarray(a - b), before, new_state.trainable)
    return grad, new_state


def test_lora_dropout_changes_the_gradient_and_zero_dropout_is_the_plain_step():
    rows = make_rows(seed=9)
    plain, _ = gradient(fresh_model(), rows)
    again, _ = gradient(fresh_model(), rows, seed=5)  # the key is irrelevant without dropout
    jax.tree.map(np.testing.assert_array_equal, plain, again)
    dropped, state = gradient(fresh_model(dropout=0.5), rows)
    same_key, _ = gradient(fresh_model(dropout=0.5), rows)
    other_key, _ = gradient(fresh_model(dropout=0.5), rows, seed=1)
    jax.tree.map(np.testing.assert_array_equal, dropped, same_key)  # reproducible per key

    def differs(a, b):
        return any(jax.tree.leaves(jax.tree.map(lambda x, y: not np.allclose(x, y), a, b)))

    assert differs(plain, dropped) and differs(dropped, other_key)
    start = jax.random.key_data(jax.random.key(0))
    assert not np.array_equal(np.asarray(state.key), np.asarray(start))  # a fresh key per step


LEAN = AttentionConfig("blockwise", q_block=4, kv_block=8)


@pytest.mark.parametrize(
    ("train", "dropout", "trajectory_level"),
    [
        ("lora", 0.3, True),
        pytest.param("full", 0.0, False, marks=pytest.mark.slow),  # ~30 s: make test-slow
    ],
)
def test_memory_lean_step_equals_the_reference_step(train, dropout, trajectory_level):
    """Blockwise attention + remat + chunked log-probs: the same loss, gradient and metrics."""
    tids = [0, 0, 1, 2, 2, 2, 3] if trajectory_level else None
    rows = make_rows(seed=4, trajectories=tids)
    batch = pack_rows(rows, micro_batch_size=4)
    cfg = LossConfig("grpo", beta=0.04)
    trainable = nnx.LoRAParam if train == "lora" else nnx.Param

    def run(lean: bool):
        model = fresh_model(dropout)
        if lean:
            model.attention, model.remat = LEAN, True
        optimizer = optax.sgd(1.0)
        graphdef, state, frozen = split_for_training(
            model, optimizer, trainable, frozen_reference=train == "full"
        )
        before = jax.tree.map(np.asarray, state.trainable)
        step = make_train_step(graphdef, optimizer, cfg, TEMPERATURE, logits_chunk=3 if lean else 0)
        new_state, metrics = step(state, frozen, batch)
        grad = jax.tree.map(lambda a, b: a - np.asarray(b), before, new_state.trainable)
        logps = make_logprob_fn(graphdef, TEMPERATURE, 3 if lean else 0)(
            new_state.trainable, frozen, batch
        )
        return grad, metrics, logps

    want_grad, want_metrics, want_logps = run(lean=False)
    got_grad, got_metrics, got_logps = run(lean=True)
    for name in ("loss", "grad_norm", "kl_mean", "tokens"):
        np.testing.assert_allclose(
            float(got_metrics[name]), float(want_metrics[name]), rtol=1e-5, err_msg=name
        )
    mask = np.asarray(batch.valid[:, :, 1:])
    np.testing.assert_allclose(
        np.asarray(got_logps)[mask], np.asarray(want_logps)[mask], rtol=1e-5, atol=1e-5
    )
    for (path, g), (_, w) in zip(
        nnx.to_flat_state(got_grad), nnx.to_flat_state(want_grad), strict=True
    ):
        scale = np.abs(w.get_value()).max()
        assert scale > 0 or train == "lora", path  # LoRA's B starts at zero only before perturb
        np.testing.assert_allclose(
            g.get_value(), w.get_value(), rtol=1e-4, atol=1e-5 * max(scale, 1e-3), err_msg=str(path)
        )


def step_outcome(batch, cfg, model=None, old_logps=False):
    """One SGD step's parameter change and metrics, and each row's masked target log-probs
    in layout order (the same order whatever the layout). `old_logps`: the batch carries the
    log-probs before the update (num_iterations > 1), made one SGD step away so ratios move."""
    optimizer = optax.sgd(1.0)
    graphdef, state, frozen = split_for_training(model or fresh_model(), optimizer)
    before = jax.tree.map(np.asarray, state.trainable)
    logps = make_logprob_fn(graphdef, TEMPERATURE)(state.trainable, frozen, batch)
    if old_logps:
        moved = jax.tree.map(lambda w: w * 1.05, state.trainable)
        batch = batch.replace(
            old_logps=make_logprob_fn(graphdef, TEMPERATURE)(moved, frozen, batch)
        )
    new_state, metrics = make_train_step(graphdef, optimizer, cfg, TEMPERATURE)(
        state, frozen, batch
    )
    grad = jax.tree.map(lambda a, b: a - np.asarray(b), before, new_state.trainable)
    mask, units = np.asarray(batch.loss_mask), np.asarray(batch.unit_ids)
    present = zip(*np.nonzero(units >= 0), strict=True)
    per_row = [np.asarray(logps)[m, i][mask[m, i]] for m, i in present]
    return grad, metrics, per_row


def by_row(outcome, layout):
    """An outcome's per-row log-probs in the rows' own order (a prefix tree reorders them)."""
    order = [k for chunk in layout for k in chunk]
    per_row = [None] * len(order)
    for k, logps in zip(order, outcome[2], strict=True):
        per_row[k] = logps
    return (*outcome[:2], per_row)


def assert_same_step(got, want, rtol=1e-5):
    for name in ("loss", "grad_norm", "kl_mean", "tokens", "ratio_mean"):
        np.testing.assert_allclose(float(got[1][name]), float(want[1][name]), rtol=rtol)
    for g, w in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-5)
    jax.tree.map(
        lambda g, w: np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6), got[0], want[0]
    )


@pytest.mark.parametrize(
    ("cfg", "trajectory_level"),
    [(LossConfig("dr_grpo", max_completion_length=8, beta=0.04), True)],
    ids=["dr_grpo_trajectory_kl"],
)
def test_packed_rows_give_the_unpacked_step(cfg, trajectory_level):
    tids = [0, 0, 1, 2, 2, 2, 3] if trajectory_level else None
    rows = make_rows(seed=6, trajectories=tids)
    want = step_outcome(pack_rows(rows, micro_batch_size=4), cfg)
    packed = pack_rows(rows, micro_batch_size=2, pack=PackShape(2, 24))
    assert packed.tokens.shape[-1] == 24 and packed.tokens.shape[1] == 2
    assert_same_step(step_outcome(packed, cfg), want)


def rows_of_groups(seed=0, groups=3, size=3):
    """Module-level group rows: `size` completions of each prompt (a row's unit is its own)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(groups):
        prompt = tuple(rng.integers(0, 64, rng.integers(4, 10)).tolist())
        for _ in range(size):
            completion = tuple(rng.integers(0, 64, rng.integers(1, 7)).tolist())
            logprobs = tuple(rng.uniform(-3, 0, len(completion)).tolist())
            rows.append(Row(prompt, completion, float(rng.normal()), -1, logprobs))
    return rows


@pytest.mark.parametrize(
    "cfg",
    [LossConfig("grpo", beta=0.04), LossConfig("gspo")],
    ids=["grpo_kl", "gspo"],
)
@pytest.mark.parametrize("room", ["roomy", "tight"])
def test_shared_prompts_give_the_unpacked_step(cfg, room):
    """Roomy: each prompt packed once; tight (sequences as long as the longest row): a group's
    rows spill into other sequences and micro-batches, where the prompt is packed again."""
    rows = rows_of_groups(seed=3)
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    pack_length = 48 if room == "roomy" else longest
    want = by_row(step_outcome(pack_rows(rows, micro_batch_size=4), cfg), [range(len(rows))])
    pack = PackShape(2, pack_length)
    shared = pack_rows(rows, micro_batch_size=2, pack=pack, share_prompts=True)
    apart = pack_rows(rows, micro_batch_size=2, pack=PackShape(2, pack_length))
    prompts = sum(len(r.prompt_ids) for r in rows[::3])
    completions = sum(len(r.completion_ids) for r in rows)
    real = int(np.asarray(shared.valid).sum())
    assert int(np.asarray(apart.valid).sum()) == 3 * prompts + completions
    if room == "roomy":
        assert real == prompts + completions
    else:
        assert prompts + completions < real < 3 * prompts + completions
    layout, _ = batch_layout(rows, 2, pack, share_prompts=True)
    assert_same_step(by_row(step_outcome(shared, cfg), layout), want)


def test_old_logprobs_carry_no_lora_dropout_unlike_trls():
    """With num_iterations > 1 the old log-probs are the policy's without dropout (a function of
    the weights alone), where TRL computes them in train mode (dropout on). So under dropout the
    first iteration's ratio is not 1 here either: it measures the dropout's effect, not drift."""
    rows = make_rows(seed=8)
    model = fresh_model(dropout=0.5)
    optimizer = optax.adam(5e-2)
    graphdef, state, frozen = split_for_training(model, optimizer)
    batch = pack_rows(rows, micro_batch_size=4)
    old = make_logprob_fn(graphdef, TEMPERATURE)(state.trainable, frozen, batch)
    without_lora_dropout = make_logprob_fn(
        *split_for_training(fresh_model(), optimizer)[:1], TEMPERATURE
    )
    same_weights = without_lora_dropout(state.trainable, frozen, batch)
    np.testing.assert_array_equal(np.asarray(old), np.asarray(same_weights))
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), TEMPERATURE)
    _, first = step(state, frozen, batch.replace(old_logps=old))
    assert abs(float(first["ratio_mean"]) - 1.0) > 1e-4  # dropout moved the current log-probs


# -- per-module adapters -------------------------------------------------------------------------
TWO_ADAPTERS = LoRAConfig(rank=4, alpha=8.0, modules=("query*=writer", "*=reader"))


def two_adapter_model():
    return perturb(Decoder(CFG, lora=TWO_ADAPTERS, rngs=nnx.Rngs(0)), scale=0.1)


def sgd_step(model, rows, num_adapters, cfg=None):
    """The step's gradient (sgd(1): old - new), its metrics and the rows' log-probs."""
    optimizer = optax.sgd(1.0)
    graphdef, state, frozen = split_for_training(model, optimizer)
    batch = pack_rows(rows, micro_batch_size=4, num_adapters=num_adapters)
    logps = make_logprob_fn(graphdef, TEMPERATURE)(state.trainable, frozen, batch)
    before = jax.tree.map(np.asarray, state.trainable)
    step = make_train_step(graphdef, optimizer, cfg or LossConfig("grpo", beta=0.04), TEMPERATURE)
    new_state, metrics = step(state, frozen, batch)
    grad = jax.tree.map(lambda a, b: a - np.asarray(b), before, new_state.trainable)
    return grad, metrics, np.asarray(logps)


def adapter_slices(grad, adapter):
    """Adapter `adapter`'s part of every stacked LoRA leaf, by path."""
    return {
        path: var.get_value()[:, adapter] if path[0] == "layers" else var.get_value()[adapter]
        for path, var in nnx.to_flat_state(grad)
    }


def test_rows_of_one_module_leave_the_other_adapter_untouched():
    """Rows of adapter 1 only, with a KL term: adapter 0's gradient is exactly zero, and adapter
    1's step is the single-adapter step on the same rows (KL reference: the base for both)."""
    rows = [dataclasses.replace(r, adapter=1) for r in make_rows(seed=10)]
    model = two_adapter_model()
    grad, metrics, _ = sgd_step(model, rows, num_adapters=2)
    assert float(metrics["grad_norm"]) > 0 and float(metrics["kl_mean"]) > 0
    for path, g in adapter_slices(grad, 0).items():
        assert not np.any(g), path  # exactly zero: adapter 0 served no row
    alone = [dataclasses.replace(r, adapter=0) for r in rows]
    want, want_metrics, _ = sgd_step(single_adapter(model, 1), alone, num_adapters=1)
    got = adapter_slices(grad, 1)
    for path, var in nnx.to_flat_state(want):
        np.testing.assert_allclose(got[path], var.get_value(), rtol=1e-4, atol=1e-7)
    for name in ("loss", "kl_mean", "grad_norm"):
        np.testing.assert_allclose(float(metrics[name]), float(want_metrics[name]), rtol=1e-5)


def test_a_mixed_batch_trains_each_adapter_as_its_own_rows_would():
    """One pass over rows of both modules = each single-adapter model on the same rows with the
    other module's advantages zeroed (same normalisers, no gradient from those rows; beta = 0,
    as a KL term would still pull on them). Log-probs: each row's adapter's."""
    rows = [dataclasses.replace(r, adapter=i % 2) for i, r in enumerate(make_rows(seed=11))]
    model = two_adapter_model()
    grpo = LossConfig("grpo")
    grad, _, logps = sgd_step(model, rows, num_adapters=2, cfg=grpo)
    batch = pack_rows(rows, micro_batch_size=4, num_adapters=2)
    adapter_ids = np.asarray(batch.adapter_ids)
    for adapter in (0, 1):
        own = [r if r.adapter == adapter else dataclasses.replace(r, advantage=0.0) for r in rows]
        alone = [dataclasses.replace(r, adapter=0) for r in own]
        want, _, want_logps = sgd_step(
            single_adapter(model, adapter), alone, num_adapters=1, cfg=grpo
        )
        got = adapter_slices(grad, adapter)
        for path, var in nnx.to_flat_state(want):
            np.testing.assert_allclose(got[path], var.get_value(), rtol=1e-4, atol=1e-7)
        mine = adapter_ids == adapter
        np.testing.assert_allclose(logps[mine], want_logps[mine], rtol=1e-5, atol=1e-5)


def test_one_adapter_by_pattern_is_todays_shared_adapter_bit_for_bit():
    rows = make_rows(seed=12)
    shared = LoRAConfig(rank=4, alpha=8.0, modules=("*=shared",))
    want = sgd_step(fresh_model(), rows, num_adapters=1)
    got = sgd_step(perturb(Decoder(CFG, lora=shared, rngs=nnx.Rngs(0)), scale=0.1), rows, 1)
    jax.tree.map(np.testing.assert_array_equal, got[0], want[0])
    np.testing.assert_array_equal(got[2], want[2])


def test_pack_rows_refuses_an_unknown_adapter():
    rows = [dataclasses.replace(r, adapter=1) for r in make_rows(seed=13)]
    with pytest.raises(ValueError, match="adapter id 1 is not below num_adapters=1"):
        pack_rows(rows, micro_batch_size=4)
    assert pack_rows(make_rows(seed=13), micro_batch_size=4).adapter_ids is None


@pytest.mark.parametrize("mode", ["token_mask", "sequence_truncate"])
def test_per_row_sampler_weights_sum_to_the_steps_mean(mode):
    """The per-row sums the trainer adds up per module are the loss's own weights: over all
    rows they give the step's sampler_weight_mean and zero fraction."""
    rows = make_rows(seed=14)  # sampler log-probs far from the policy's: weights vary
    cfg = LossConfig("grpo", sampler_correction=mode, sampler_correction_min=0.5)
    optimizer = optax.sgd(0.0)
    graphdef, state, frozen = split_for_training(fresh_model(), optimizer)
    step = make_train_step(graphdef, optimizer, cfg, TEMPERATURE)
    batch = pack_rows(rows, micro_batch_size=3)
    _, metrics = step(state, frozen, batch)
    weight, zeros, tokens = (np.asarray(metrics[k]) for k in ROW_SAMPLER_KEYS)
    assert weight.shape == (3, 3)
    mask = np.asarray(batch.loss_mask).sum(-1)
    np.testing.assert_array_equal(tokens, mask)
    mean = float(metrics["sampler_weight_mean"])
    np.testing.assert_allclose(weight.sum() / tokens.sum(), mean, rtol=1e-5)
    zero = float(metrics["sampler_weight_zero_fraction"])
    np.testing.assert_allclose(zeros.sum() / tokens.sum(), zero, rtol=1e-6)
    assert mean != pytest.approx(1.0) and (mode == "sequence_truncate" or zero > 0)
    without = make_train_step(graphdef, optimizer, LossConfig("grpo"), TEMPERATURE)
    _, plain = without(split_for_training(fresh_model(), optimizer)[1], frozen, batch)
    assert not any(k.startswith(ROW_METRIC) for k in plain)  # only with a correction


def test_shared_prompts_find_a_prompts_rows_wherever_they_come():
    """Rows of one prompt far apart in the step (as in update_profile.py's rows) still share."""
    rows = rows_of_groups(seed=4)
    interleaved = rows[0::3] + rows[1::3] + rows[2::3]
    shared = pack_rows(interleaved, micro_batch_size=1, pack=PackShape(1, 48), share_prompts=True)
    prompts = sum(len(r.prompt_ids) for r in rows[::3])
    completions = sum(len(r.completion_ids) for r in rows)
    assert int(np.asarray(shared.valid).sum()) == prompts + completions


# -- prefix trees over a program's step ----------------------------------------------------------
TREE_CASES = {
    "grpo_kl_replies_differ": (LossConfig("grpo", beta=0.04), False, False),
    "grpo_kl_replies_agree": (LossConfig("grpo", beta=0.04), True, False),
    "gspo_replies_differ": (LossConfig("gspo"), False, False),
    "num_iterations_2": (LossConfig("grpo", beta=0.04), False, True),
}


# make test runs one adapter and per-module adapters on the first two cases (and per-module on
# num_iterations 2); the rest run with the slow tests (CI's make test-slow)
TREE_SLOW = {("gspo_replies_differ", 1), ("gspo_replies_differ", 2), ("num_iterations_2", 1)}
TREE_PARAMS = [
    pytest.param(
        *case,
        adapters,
        id=f"{name}-{'one' if adapters == 1 else 'per_module'}_adapter",
        marks=[pytest.mark.slow] if (name, adapters) in TREE_SLOW else [],
    )
    for name, case in TREE_CASES.items()
    for adapters in (1, 2)
]


@pytest.mark.parametrize(("cfg", "agree", "old", "adapters"), TREE_PARAMS)
def test_a_prefix_tree_step_equals_the_padded_step(cfg, agree, old, adapters):
    """A two-module step whose instruction, group prompts (and agreeing replies) the tree holds
    once: loss, gradients, KL, ratios and every row's log-probs are the padded step's, with one
    adapter and with each module on its own (packed side by side, never in one tree node)."""
    rows = program_rows(seed=21, agree=agree, adapters=adapters)
    model = (two_adapter_model if adapters > 1 else fresh_model)()
    want = step_outcome(pack_rows(rows, 6, num_adapters=adapters), cfg, model, old)
    want = by_row(want, [range(len(rows))])
    pack = PackShape(2, 96)
    tree = pack_rows(rows, 2, pack, num_adapters=adapters, share_prompts=True)
    real = int(np.asarray(tree.valid).sum())
    assert real < 0.6 * sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    layout, _ = batch_layout(rows, 2, pack, share_prompts=True)
    got = by_row(step_outcome(tree, cfg, model, old), layout)
    assert_same_step(got, want)
    assert float(got[1]["grad_norm"]) > 0 and (not old or float(got[1]["ratio_mean"]) != 1.0)


def test_bnpo_packed_keeps_the_padded_micro_batches_and_their_token_means():
    """bnpo normalises by each micro-batch's own tokens: packed with keep_micro_batches (what
    the trainer does for it), each micro-batch holds the padded layout's rows and the step is
    the padded step; packed freely, the micro-batches and so the loss differ."""
    rows = program_rows(seed=22)
    cfg = LossConfig("bnpo", beta=0.04)
    want = by_row(step_outcome(pack_rows(rows, 4), cfg), [range(len(rows))])
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    pack = PackShape(4, longest)
    kept = pack_rows(rows, 4, pack, share_prompts=True, keep_micro_batches=True)
    assert kept.tokens.shape[0] == -(-len(rows) // 4)
    assert int(np.asarray(kept.valid).sum()) < sum(
        len(r.prompt_ids) + len(r.completion_ids) for r in rows
    )
    layout, _ = batch_layout(rows, 4, pack, share_prompts=True, keep_micro_batches=True)
    assert_same_step(by_row(step_outcome(kept, cfg), layout), want)
    free = pack_rows(rows, 4, PackShape(2, 96), share_prompts=True)
    assert abs(float(step_outcome(free, cfg)[1]["loss"]) - float(want[1]["loss"])) > 1e-4
