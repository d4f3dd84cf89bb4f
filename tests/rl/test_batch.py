import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmgrpo_jax.program.trace import CallRecord
from mmgrpo_jax.rl.advantages import advantages_for_groups
from mmgrpo_jax.rl.batch import PackShape, Row, pack_rows, rows_from_groups
from mmgrpo_jax.rl.grouping import (
    Group,
    GroupMember,
    module_level_groups,
    trajectory_level_groups,
)
from mmgrpo_jax.rl.losses import LossConfig, LossRows, policy_loss
from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.trainer.config import MMGRPOConfig
from programs import synthetic


def make_rows(seed=0, n=7, trajectories=None):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(0, 64, rng.integers(3, 9)).tolist()
        completion = rng.integers(0, 64, rng.integers(1, 7)).tolist()
        unit = -1 if trajectories is None else trajectories[i]
        logprobs = tuple(rng.uniform(-3, 0, len(completion)).tolist())
        rows.append(Row(tuple(prompt), tuple(completion), float(rng.normal()), unit, logprobs))
    return rows


def test_pack_rows_masks_completion_targets_only_and_carries_sampler_logprobs():
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
        sampler = np.asarray(batch.sampler_logps[m, i])
        np.testing.assert_allclose(sampler[p - 1 : p + c - 1], row.sampler_logprobs, rtol=1e-6)
        assert not sampler[: p - 1].any() and not sampler[p + c - 1 :].any()
    assert not np.asarray(batch.valid[2, 1:]).any()  # padding rows are empty
    assert np.asarray(batch.has_sampler_logps).sum() == 7
    assert np.asarray(batch.num_sequences).tolist() == [7, 7, 7]  # every row its own unit
    assert np.asarray(batch.unit_ids).tolist() == [[0, 1, 2], [0, 1, 2], [0, -1, -1]]
    assert float(batch.num_tokens[0]) == sum(len(r.completion_ids) for r in rows)


def test_pack_rows_keeps_units_whole():
    rows = make_rows(trajectories=[5, 5, 9, 9, 9, 2, 7])
    batch = pack_rows(rows, micro_batch_size=4)
    ids = np.asarray(batch.unit_ids).tolist()
    assert ids == [[0, 0, -1, -1], [0, 0, 0, 1], [0, -1, -1, -1]]
    assert float(batch.num_sequences[0]) == 4
    with pytest.raises(ValueError, match=r"unit 9 .* has 3 rows, more than micro_batch_size=2"):
        pack_rows(rows, micro_batch_size=2)


def test_rows_reject_bad_input():
    with pytest.raises(ValueError, match="at least one prompt token"):
        Row((), (1,), 0.0)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1, got 0"):
        pack_rows(make_rows(), micro_batch_size=0)
    with pytest.raises(ValueError, match="no rows"):
        pack_rows([], micro_batch_size=2)


def synthetic_groups(trajectory_level):
    table = synthetic.LinkTable.make(4, seed=0)
    program = synthetic.LinkFollower(table, max_links=2)
    examples = synthetic.make_examples(table, 2, max_links=2, seed=0)
    lm = synthetic.noisy_policy(program, accuracy=0.6, format_error_rate=0.1, seed=2)
    trajectories = run_rollouts(program, examples, synthetic.metric, num_rollouts=4, lm=lm)
    groups = (trajectory_level_groups if trajectory_level else module_level_groups)(trajectories)
    return trajectories, groups, advantages_for_groups(groups)


def unit(trajectory_level):
    return "trajectory" if trajectory_level else "row"


@pytest.mark.parametrize("trajectory_level", [False, True])
def test_rows_from_groups_carry_the_sampled_ids_and_advantages(trajectory_level):
    trajectories, groups, advantages = synthetic_groups(trajectory_level)
    rows = rows_from_groups(groups, advantages, unit=unit(trajectory_level))
    expected = [
        (call, float(a), k)
        for k, (member, a) in enumerate(
            (m, a)
            for g, adv in zip(groups, advantages, strict=True)
            for m, a in zip(g.members, adv, strict=True)
        )
        for call in member.calls
    ]
    assert len(rows) == len(expected)
    for i, (row, (call, advantage, member)) in enumerate(zip(rows, expected, strict=True)):
        assert row.prompt_ids == call.prompt_ids and row.completion_ids == call.completion_ids
        assert row.advantage == advantage and row.unit == (member if trajectory_level else i)
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
    assert float(batch.num_tokens[0]) == sum(len(r.completion_ids) for r in rows[1:])
    no_ids = dataclasses.replace(truncated_call, completion_ids=None)
    groups[0] = dataclasses.replace(
        groups[0], members=(dataclasses.replace(member, calls=(no_ids,)), *groups[0].members[1:])
    )
    with pytest.raises(ValueError, match=r"start\[0\] has no token ids"):
        rows_from_groups(groups, advantages)


@pytest.mark.parametrize("trajectories", [None, [0, 0, 1, 2, 2, 2, 3]])
def test_packed_rows_hold_every_row_once_with_restarting_positions(trajectories):
    rows = make_rows(seed=2, trajectories=trajectories)
    batch = pack_rows(rows, micro_batch_size=2, pack=PackShape(2, 24))
    tokens, segments = np.asarray(batch.tokens), np.asarray(batch.segments)
    positions, index = np.asarray(batch.positions), np.asarray(batch.target_index)
    slots, targets = np.asarray(batch.target_slot), np.asarray(batch.target_tokens)
    target_rows = np.asarray(batch.target_row)
    assert tokens.shape[1:] == (2, 24) and batch.loss_mask.shape[2] == 15  # rows keep [b, L-1]
    seen = []
    for m in range(tokens.shape[0]):
        units = np.asarray(batch.unit_ids[m])
        for i in np.flatnonzero(units >= 0):
            mask = np.asarray(batch.loss_mask[m, i])
            (seq,) = {s for s in range(2) if (segments[m, s] == i).any()}
            row_tokens = tokens[m, seq][segments[m, seq] == i]
            seen.append(tuple(row_tokens.tolist()))
            assert positions[m, seq][segments[m, seq] == i].tolist() == list(range(len(row_tokens)))
            # the row's targets sit with its sequence's, in order, at its loss-mask slots
            mine = target_rows[m, seq] == i
            assert slots[m, seq][mine].tolist() == np.flatnonzero(mask).tolist()
            # position t predicts token t + 1 of the sequence: the row's completion
            completion = row_tokens[-int(mask.sum()) :].tolist()
            assert tokens[m, seq][index[m, seq][mine] + 1].tolist() == completion
            assert targets[m, seq][mine].tolist() == completion
    assert sorted(seen) == sorted(r.prompt_ids + r.completion_ids for r in rows)
    if trajectories is not None:  # a trajectory's rows share one micro-batch
        per_micro = [set(np.asarray(batch.unit_ids[m])) - {-1} for m in range(tokens.shape[0])]
        assert sum(len(u) for u in per_micro) == 4


def test_packing_cuts_the_padding_of_a_hover_like_step():
    """Many short module calls and a few long ones: padding to the longest wastes most slots."""
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(20, 60, 40), *rng.integers(200, 250, 4)]
    rows = [Row(tuple(range(1, n)), (7,), 0.5) for n in lengths]
    padded = pack_rows(rows, micro_batch_size=8)
    packed = pack_rows(rows, micro_batch_size=2, pack=PackShape(2, 256))
    assert padded.padding_fraction > 0.75 and packed.padding_fraction < 0.25
    assert packed.tokens.size < padded.tokens.size / 3


def test_a_row_longer_than_the_pack_is_named():
    rows = make_rows(seed=1)
    with pytest.raises(ValueError, match=r"row of \d+ tokens does not fit memory.pack_length=8"):
        pack_rows(rows, micro_batch_size=2, pack=PackShape(2, 8))


def test_row_lengths_pad_to_multiples_of_64_up_to_512():
    from mmgrpo_jax.rl.batch import row_length_bucket

    assert [row_length_bucket(n) for n in (1, 17, 64, 65, 190, 512)] == [16, 32, 64, 128, 192, 512]
    assert [row_length_bucket(n) for n in (513, 6000)] == [1024, 6144]  # the sampler's buckets


# ------------------------------------------------------- loss units (MMGRPOConfig.loss_unit)


def _call(predictor, n_tokens, invocation=0):
    return CallRecord(
        predictor,
        invocation,
        (),
        "",
        (1, 2),
        tuple(range(3, 3 + n_tokens)),
        None,
        "stop",
        True,
        None,
        {},
    )


def _mass(groups, unit):
    """Each row's share of the loss's gradient (|d loss / d log-prob| summed over its tokens) at
    ratio 1 with advantage 1, under grpo with the rows' unit ids: what a unit weighs."""
    row_unit = "row" if unit == "token" else unit  # token units: rows alone, a token mean
    rows = rows_from_groups(groups, [np.ones(len(g.members)) for g in groups], unit=row_unit)
    width = max(len(r.completion_ids) for r in rows)
    mask = np.array([[t < len(r.completion_ids) for t in range(width)] for r in rows])
    ids = np.array([r.unit for r in rows])
    _, ids = np.unique(ids, return_inverse=True)  # renumbered, as pack_rows does
    aggregation = "token_mean_global" if unit == "token" else "sequence_mean"
    cfg = LossConfig("grpo", aggregation=aggregation)

    def loss(logps):
        ones = jnp.ones(len(rows))
        loss_rows = LossRows(ones, jnp.asarray(mask), jnp.asarray(ids))
        return policy_loss(cfg, logps, logps, loss_rows)[0]

    grad = np.asarray(jax.grad(loss)(jnp.full(mask.shape, -1.0)))
    return rows, -grad.sum(1)


def _two_rollouts(first_calls, second_calls, example=0, first_rollout=0):
    """Module-level groups of one example, two rollouts: one group per (module, invocation)."""
    by_module = {}
    for rollout, calls in enumerate((first_calls, second_calls), start=first_rollout):
        for call in calls:
            key = (call.predictor, call.invocation)
            by_module.setdefault(key, []).append(GroupMember(rollout, 1.0, (call,)))
    return [Group(example, m, k, tuple(members)) for (m, k), members in by_module.items()]


def test_under_trajectory_units_splitting_a_trajectorys_tokens_over_calls_keeps_its_weight():
    whole = _two_rollouts([_call("a", 4)], [_call("a", 2)])
    split = _two_rollouts([_call("a", 2), _call("b", 2)], [_call("a", 2)])
    for groups in (whole, split):
        rows, mass = _mass(groups, "rollout")
        first = [i for i, r in enumerate(rows) if r.unit == rows[0].unit]
        np.testing.assert_allclose(mass[first].sum(), 0.5, rtol=1e-6)  # one of two trajectories
    _, by_call = _mass(split, "row")  # call units: the split trajectory's 2 calls weigh 2/3
    np.testing.assert_allclose(by_call.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(sorted(by_call), [1 / 3] * 3, rtol=1e-6)


def test_under_example_units_the_group_size_does_not_change_an_examples_weight():
    small = _two_rollouts([_call("a", 3)], [_call("a", 1)], example=0)  # G = 2
    large = _two_rollouts([_call("a", 2)], [_call("a", 5)], example=1)
    large += _two_rollouts([_call("a", 1)], [_call("a", 4)], example=1, first_rollout=2)  # G=4
    for unit, want in [("example", [0.5, 0.5]), ("rollout", [2 / 6, 4 / 6])]:
        rows, mass = _mass(small + large, unit)
        first = [i for i in range(len(rows)) if i < 2]  # example 0's two rows come first
        np.testing.assert_allclose([mass[first].sum(), mass[2:].sum()], want, rtol=1e-6)
    _, by_token = _mass(small + large, "token")  # token units: every token alike
    np.testing.assert_allclose(by_token.sum(), 1.0, rtol=1e-6)


@pytest.mark.parametrize("select_k", [None, 6])
def test_trajectory_units_on_trajectory_groups_are_the_paper_objective_exactly(select_k):
    """loss_unit="trajectory" on trajectory-level groups = the trajectory-level objective: the
    same unit partition as a group member (repeats from select-K counted twice)."""
    trajectories, _, _ = synthetic_groups(trajectory_level=True)
    groups = trajectory_level_groups(trajectories, select_k=select_k, num_rollouts=4)
    advantages = advantages_for_groups(groups)
    members = rows_from_groups(groups, advantages, unit="trajectory")
    rollouts = rows_from_groups(groups, advantages, unit="rollout")
    assert [r.unit for r in members] == [r.unit for r in rollouts]
    module_rows = rows_from_groups(*synthetic_groups(False)[1:], unit="rollout")
    assert len({r.unit for r in module_rows}) == 8  # 2 examples x 4 rollouts, across modules


def test_loss_unit_config_sets_the_aggregation_and_refuses_what_it_would_redefine():
    for unit, aggregation in [("token", "token_mean_global"), ("call", "sequence_mean")]:
        cfg = MMGRPOConfig(loss_unit=unit, loss=LossConfig("dapo"))
        assert cfg.resolved_loss.aggregation_name == aggregation and cfg.row_unit == "row"
    assert MMGRPOConfig(grouping="trajectory").row_unit == "trajectory"  # null: the rule's
    assert MMGRPOConfig(grouping="module", loss_unit="trajectory").row_unit == "rollout"
    assert MMGRPOConfig().resolved_loss.aggregation_name == "sequence_mean"  # grpo's own
    with pytest.raises(ValueError, match="loss_unit must be one of"):
        MMGRPOConfig(loss_unit="group")
    with pytest.raises(ValueError, match=r"loss_unit='call' sets .*='dr_grpo' aggregates by"):
        MMGRPOConfig(loss_unit="call", loss=LossConfig("dr_grpo"))
    with pytest.raises(ValueError, match=r"LossConfig\.aggregation must be a registered"):
        LossConfig("grpo", aggregation="median")


def test_packed_targets_are_grouped_by_sequence_so_the_lm_head_scores_no_more_than_it():
    """Many short rows and one long completion: per-row windows would score rows x longest."""
    rows = [Row((1, 2, 3), (4, 5), 0.5) for _ in range(40)] + [Row((1,), tuple(range(60)), 0.5)]
    batch = pack_rows(rows, micro_batch_size=2, pack=PackShape(2, 128))
    m, sequences, window = batch.target_tokens.shape
    assert sequences == 2 and window <= 128
    assert m * sequences * window < len(rows) * 64  # what a per-row window of 64 would score
    placed = np.asarray(batch.target_row) < batch.unit_ids.shape[1]
    assert placed.sum() == sum(len(r.completion_ids) for r in rows)


def _loss_and_gradient(rows, variant, logps_of):
    """The loss of `rows` (off the policy: ratios away from 1) and d loss / d log-prob per call."""
    width = max(len(r.completion_ids) for r in rows)
    mask = np.array([[t < len(r.completion_ids) for t in range(width)] for r in rows])
    _, ids = np.unique([r.unit for r in rows], return_inverse=True)
    old = np.array([np.pad(logps_of(r), (0, width - len(r.completion_ids))) for r in rows])
    new = jnp.asarray(old * 0.9)  # every token's ratio moves, some past the clip
    advantages = jnp.asarray([r.advantage for r in rows])

    def loss(logps):
        cfg = LossConfig(variant)
        rows = LossRows(advantages, jnp.asarray(mask), jnp.asarray(ids))
        return policy_loss(cfg, logps, jnp.asarray(old), rows)[0]

    value, grad = jax.value_and_grad(loss)(new)
    grad = np.asarray(grad)
    per_call = {
        (r.prompt_ids, r.completion_ids, r.advantage): tuple(grad[i, : len(r.completion_ids)])
        for i, r in enumerate(rows)
    }
    return float(value), per_call


def test_one_call_per_module_makes_module_and_trajectory_groups_one_token_level_objective():
    """The study's finding as an invariant: when every trajectory calls each module once (as
    capitals does), a module's group holds the same rollouts as the trajectory group, so the
    advantages agree; a token-level loss (dapo) then gives the same step under either grouping,
    and only a loss that weighs units (grpo's per-sequence mean: a call vs a trajectory) differs.
    """
    table = synthetic.LinkTable.make(4, seed=0)
    program = synthetic.LinkFollower(table, max_links=1)  # start once, hop once
    examples = synthetic.make_examples(table, 3, max_links=1, seed=1)
    lm = synthetic.noisy_policy(program, accuracy=0.5, format_error_rate=0.0, seed=3)
    trajectories = run_rollouts(program, examples, synthetic.metric, num_rollouts=4, lm=lm)
    assert all(len(t.calls) == 2 for t in trajectories)
    module = module_level_groups(trajectories)
    trajectory = trajectory_level_groups(trajectories)
    by_module = rows_from_groups(module, advantages_for_groups(module), unit="row")
    by_trajectory = rows_from_groups(
        trajectory, advantages_for_groups(trajectory), unit="trajectory"
    )
    assert len({r.advantage for r in by_module}) > 2  # the rewards differ within groups
    key = lambda r: (r.prompt_ids, r.completion_ids, r.advantage)  # noqa: E731
    assert sorted(map(key, by_module)) == sorted(map(key, by_trajectory))
    rng = np.random.default_rng(0)
    logps = {key(r): rng.uniform(-2, -0.1, len(r.completion_ids)) for r in by_module}
    logps_of = lambda r: logps[key(r)]  # noqa: E731
    dapo = [_loss_and_gradient(rows, "dapo", logps_of) for rows in (by_module, by_trajectory)]
    np.testing.assert_allclose(dapo[0][0], dapo[1][0], atol=1e-7)  # float32 sum order
    for call, grad in dapo[0][1].items():
        np.testing.assert_allclose(grad, dapo[1][1][call], rtol=1e-5, atol=1e-9)
    grpo = [_loss_and_gradient(rows, "grpo", logps_of) for rows in (by_module, by_trajectory)]
    differs = [not np.allclose(g, grpo[1][1][c], rtol=1e-3) for c, g in grpo[0][1].items()]
    assert any(differs), "grpo weighs a call under module groups, a trajectory under the other"


def program_rows(seed=0, agree=False, inputs=3, size=3, adapters=1):
    """A two-module step's rows: each module's prompts open with its instruction (shared across
    inputs), then the input; `size` completions per (module, input), all equal when `agree`,
    else each with its own first token. Module k's rows use adapter k % adapters."""
    rng = np.random.default_rng(seed)
    rows = []
    for module in range(2):
        instruction = tuple(rng.integers(0, 64, 6).tolist())
        for _ in range(inputs):
            prompt = instruction + tuple(rng.integers(0, 64, rng.integers(2, 6)).tolist())
            reply = tuple(rng.integers(0, 64, rng.integers(2, 7)).tolist())
            for g in range(size):
                completion = reply if agree else (g, *rng.integers(0, 64, rng.integers(1, 6)))
                completion = tuple(int(t) for t in completion)
                logprobs = tuple(rng.uniform(-3, 0, len(completion)).tolist())
                advantage = float(rng.normal())
                rows.append(
                    Row(prompt, completion, advantage, -1, logprobs, adapter=module % adapters)
                )
    return rows


def trie_size(rows):
    """Distinct (adapter, prefix) pairs: the tokens a prefix tree of the rows holds."""
    return len(
        {
            (r.adapter, (r.prompt_ids + r.completion_ids)[: n + 1])
            for r in rows
            for n in range(len(r.prompt_ids) + len(r.completion_ids))
        }
    )


@pytest.mark.parametrize("agree", [False, True], ids=["replies_differ", "replies_agree"])
@pytest.mark.parametrize("adapters", [1, 2])
def test_a_prefix_tree_holds_each_shared_prefix_once_and_each_row_sees_its_own_path(
    agree, adapters
):
    """Roomy sequences: the packed tokens are exactly the trie's (instructions across inputs,
    a group's prompt, agreeing replies: each once), and a row's last token attends to its own
    tokens and nothing else, in order, at positions 0.. along its path."""
    from mmgrpo_jax.rl.batch import batch_layout
    from models.attention import AttentionMask

    rows = program_rows(seed=5, agree=agree, adapters=adapters)
    pack = PackShape(2, 128)
    batch = pack_rows(rows, 2, pack, num_adapters=adapters, share_prompts=True)
    assert batch.segments is None and batch.reach is not None
    assert int(np.asarray(batch.valid).sum()) == trie_size(rows)
    padded_tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    assert trie_size(rows) < padded_tokens - 2 * 6 * (3 - 1)  # the instructions, at least
    layout, placements = batch_layout(rows, 2, pack, share_prompts=True)
    tokens, positions = np.asarray(batch.tokens), np.asarray(batch.positions)
    allowed = np.asarray(
        jax.vmap(lambda v, r: AttentionMask.causal(v, None, r).dense())(batch.valid, batch.reach)
    )
    for m, (chunk, spots) in enumerate(zip(layout, placements, strict=True)):
        for k, spot in zip(chunk, spots, strict=True):
            row, seq, slots = rows[k], spot.sequence, spot.slots
            assert tokens[m, seq, slots].tolist() == list(row.prompt_ids + row.completion_ids)
            assert positions[m, seq, slots].tolist() == list(range(len(slots)))
            assert np.flatnonzero(allowed[m, seq, slots[-1]]).tolist() == slots.tolist()
            if adapters > 1:
                assert set(np.asarray(batch.token_adapters)[m, seq, slots]) == {row.adapter}


def test_a_tight_prefix_tree_spills_into_new_sequences_and_keeps_units_together():
    rows = program_rows(seed=6)
    rows = [dataclasses.replace(r, unit=k // 2) for k, r in enumerate(rows)]  # pairs of rows
    longest = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    batch = pack_rows(rows, 2, PackShape(2, longest), share_prompts=True)
    real = int(np.asarray(batch.valid).sum())
    assert trie_size(rows) < real < sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
    per_micro = [set(np.asarray(batch.unit_ids[m])) - {-1} for m in range(batch.tokens.shape[0])]
    assert sum(len(u) for u in per_micro) == len(rows) // 2  # no unit split over micro-batches


def test_pack_shape_holds_a_groups_tree_within_the_padded_budget():
    """Sequences long enough for one prompt's G rows, no more slots than padding would use,
    a cap obeyed, and a cap below the longest row named."""
    from mmgrpo_jax.rl.batch import pack_shape, row_length_bucket

    prompt = tuple(range(1, 201))
    rows = [Row(prompt, (g, *range(8, 20)), 0.5) for g in range(8)]
    longest = row_length_bucket(213)
    shape = pack_shape(rows, micro_batch_size=8)
    assert shape.length == row_length_bucket(200 + 8 * 13) and shape.length > longest
    assert shape.sequences * shape.length <= 8 * longest
    apart = pack_shape(rows, micro_batch_size=8, share_prompts=False)
    assert (apart.sequences, apart.length) == (8, longest)
    assert pack_shape(rows, 8, cap=220).length == 220
    assert pack_shape(rows, 8, row_multiple=4).sequences % 4 == 0
    with pytest.raises(ValueError, match=r"row of 213 tokens does not fit memory.pack_length=100"):
        pack_shape(rows, 8, cap=100)
