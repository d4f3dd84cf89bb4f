"""What a step logs: rollouts, groups and their advantages per module, the update, the
engine's share of the time. One place, so metrics.jsonl's keys are read off one function."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from mmgrpo_jax.engines.base import EngineStats
from mmgrpo_jax.rl.grouping import Group
from mmgrpo_jax.rl.rollout import summarize
from mmgrpo_jax.rl.types import Trajectory


def step_metrics(
    trajectories: Sequence[Trajectory],
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    update: dict[str, float],
    seconds: dict[str, float],
    engine: EngineStats,
) -> dict[str, float]:
    """Everything a step logs, gathered in one place. `engine`: the step's share of the
    engine's stats (where the rollouts' time went: sampling, or the programs and tools)."""
    metrics: dict[str, float] = {k: float(v) for k, v in summarize(trajectories).items()}
    metrics["reward_std"] = float(np.std([t.reward for t in trajectories]))
    sampled = sum(
        len(c.completion_ids or ()) for t in trajectories for c in t.calls if not c.replayed
    )
    metrics["rollout_tokens_per_s"] = sampled / max(seconds["rollout"], 1e-9)
    metrics["groups"] = float(len(groups))
    # calls answered from another rollout's record, not sampled (branch rollouts' shared prefix)
    metrics["calls_replayed"] = float(sum(c.replayed for t in trajectories for c in t.calls))
    metrics.update(group_diagnostics(groups, advantages))
    lengths: dict[str, list[int]] = {}
    grouped: set[int] = set()
    for group in groups:
        for member in group.members:
            for call in member.calls:
                if id(call) not in grouped:
                    lengths.setdefault(call.predictor, []).append(len(call.completion_ids or ()))
                grouped.add(id(call))
    for name, values in lengths.items():
        metrics[f"completion_length/{name}"] = float(np.mean(values))
    # calls that gave no training row, and why: in no group (the alignment dropped them, or a
    # branch rollout shares them), or nothing generated
    ungrouped: Counter[str] = Counter()
    empty: Counter[str] = Counter()
    for t in trajectories:
        for call in t.calls:
            ungrouped[call.predictor] += id(call) not in grouped
            empty[call.predictor] += id(call) in grouped and not call.completion_ids
    for name in sorted(ungrouped):
        metrics[f"calls_ungrouped/{name}"] = float(ungrouped[name])
        metrics[f"calls_empty/{name}"] = float(empty[name])
    metrics.update({f"time/{k}": v for k, v in seconds.items()})
    if update:
        metrics.update(update)
        metrics["train_tokens_per_s"] = update["tokens"] / max(seconds["train"], 1e-9)
    metrics["sampler_occupancy"] = engine.occupancy
    metrics["time/queue_wait"] = engine.mean_queue_wait_s  # per request, submit to start
    # programs compiled by the engine in this step (a resumed run compiles its shapes again)
    metrics["perf/sampler_compiles"] = float(engine.compiles)
    # prefill saved: prompt tokens whose keys and values were copied from a slot that held them
    metrics["sampler_prompt_tokens"] = float(engine.prompt_tokens)
    metrics["sampler_shared_prefix_tokens"] = float(engine.shared_prefix_tokens)
    metrics["sampler_prefill_saved"] = engine.prefill_saved
    # the engine's own seconds in sampler calls; the rest of the rollouts' wall time is the
    # programs' (and their tools') time not hidden behind sampling
    metrics["time/sampling"] = engine.sample_s
    metrics["time/program"] = max(seconds["rollout"] - engine.sample_s, 0.0)
    return metrics


def group_diagnostics(
    groups: Sequence[Group], advantages: Sequence[np.ndarray]
) -> dict[str, float]:
    """Per module (and per (module, invocation) for a module called several times in a
    trajectory; "trajectory" for trajectory-level groups): how many groups, the fraction with no
    reward spread (no gradient), the mean number of distinct members (below G when padding or
    select-K repeated some), and the advantages' mean and spread."""
    by_key: dict[str, list[tuple[Group, np.ndarray]]] = {}
    invocations: dict[str, set[int]] = {}
    for group, adv in zip(groups, advantages, strict=True):
        name = group.module or "trajectory"
        by_key.setdefault(name, []).append((group, adv))
        if group.invocation is not None:
            invocations.setdefault(name, set()).add(group.invocation)
            by_key.setdefault(f"{name}#{group.invocation}", []).append((group, adv))
    metrics = {}
    for key, items in by_key.items():
        module, _, invocation = key.partition("#")
        if invocation and len(invocations.get(module, ())) < 2:
            continue  # one invocation: the module's own numbers say it all
        values = np.concatenate([adv for _, adv in items])
        distinct = [len({m.rollout_index for m in g.members}) for g, _ in items]
        metrics[f"groups/{key}"] = float(len(items))
        metrics[f"zero_variance_fraction/{key}"] = float(
            np.mean([not np.any(adv) for _, adv in items])
        )
        metrics[f"distinct_members/{key}"] = float(np.mean(distinct))
        metrics[f"advantage_mean/{key}"] = float(np.mean(values))
        metrics[f"advantage_std/{key}"] = float(np.std(values))
    return metrics
