import json
from collections import Counter

from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.testing import ScriptedLM
from programs import synthetic


def test_table_is_a_single_cycle():
    table = synthetic.LinkTable.make(6, seed=3)
    word, seen = table.words[0], []
    for _ in range(6):
        seen.append(word)
        word = table.follow(word)
    assert word == table.words[0] and sorted(seen) == list(table.words)


def test_perfect_policy_scores_one_with_a_variable_number_of_hops():
    table = synthetic.LinkTable.make(6, seed=0)
    program = synthetic.LinkFollower(table, max_links=3)
    examples = synthetic.make_examples(table, 12, max_links=3, seed=1)
    lm = synthetic.noisy_policy(program, accuracy=1.0, format_error_rate=0.0)
    trajectories = run_rollouts(program, examples, synthetic.metric, num_rollouts=2, lm=lm)
    assert all(t.status == "ok" and t.reward == 1.0 for t in trajectories)
    hops = Counter(sum(c.predictor == "hop" for c in t.calls) for t in trajectories)
    assert set(hops) == {2, 3}  # n links -> n + 1 hop calls, capped at max_links
    assert all(c.completion_ids and c.logprobs for t in trajectories for c in t.calls)


def test_wrong_start_word_gets_zero_reward():
    table = synthetic.LinkTable.make(6, seed=0)
    program = synthetic.LinkFollower(table, max_links=2)
    [example] = synthetic.make_examples(table, 1, max_links=2, seed=2)
    wrong = next(w for w in table.words if w not in example.clue)
    replies = [f"[[ ## start ## ]]\n{wrong}", "[[ ## done ## ]]\ntrue"]
    [t] = run_rollouts(
        program,
        [example],
        synthetic.metric,
        num_rollouts=1,
        lm=ScriptedLM.from_replies(replies),
    )
    assert (t.status, t.reward, t.prediction.answer) == ("ok", 0.0, wrong)


def test_sixteen_concurrent_rollouts_each_trace_their_own_path():
    table = synthetic.LinkTable.make(6, seed=0)
    program = synthetic.LinkFollower(table, max_links=3)
    examples = synthetic.make_examples(table, 1, max_links=3, seed=4)
    lm = synthetic.noisy_policy(program, accuracy=0.5, format_error_rate=0.0, seed=1)
    trajectories = run_rollouts(program, examples, synthetic.metric, num_rollouts=16, lm=lm)
    assert len(trajectories) == 16
    for t in trajectories:
        path = t.prediction.path
        start, *hops = t.calls
        assert start.outputs["start"] == path[0]
        assert [c.invocation for c in hops] == list(range(len(hops)))
        # the k-th hop call saw the first k + 1 words of this rollout's own path
        assert [c.messages[-1]["content"].split("\n")[-1] for c in hops] == [
            json.dumps(path[: k + 1]) for k in range(len(hops))
        ]
    assert len({tuple(t.prediction.path) for t in trajectories}) > 1  # rollouts really differ
