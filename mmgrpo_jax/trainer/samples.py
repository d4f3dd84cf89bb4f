"""What a step sampled, as a researcher reads it: every call of some of the step's examples with
its prompt, reply, reward, group and advantage, in `samples.jsonl` beside metrics.jsonl.

Multi-module credit is hard to debug from scalars: which call of which rollout got which
advantage, and did it train? A record is one call's place in one group (a call that padding or
select-K repeated has one record per place; a call in no group has one record with `group`
null), so a step's records give back its groups exactly. `samples_per_step` examples a step
are written (all their rollouts, so each group is whole); `mmgrpo samples RUN_DIR` prints one
step's groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.rl.grouping import Group
from mmgrpo_jax.rl.types import Trajectory
from mmgrpo_jax.trainer.run_log import SAMPLES_FILE, read_rows


def step_samples(
    step: int,
    trajectories: Sequence[Trajectory],
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    *,
    examples: int,
    mask_truncated_completions: bool = False,
) -> list[dict[str, Any]]:
    """The records of the first `examples` examples of a step (all of them when < 0), ordered
    by (example, rollout, call, place in a group). `step` counts from 1, as metrics.jsonl's."""
    chosen = sorted({t.example_index for t in trajectories})
    if examples >= 0:
        chosen = chosen[:examples]
    wanted = set(chosen)
    places: dict[int, list[tuple[int, int, float]]] = {}  # id(call) -> (group, member, advantage)
    for g, (group, group_advantages) in enumerate(zip(groups, advantages, strict=True)):
        if group.example_index not in wanted:
            continue
        for m, (member, advantage) in enumerate(zip(group.members, group_advantages, strict=True)):
            for call in member.calls:
                places.setdefault(id(call), []).append((g, m, float(advantage)))
    records = []
    for trajectory in sorted(trajectories, key=lambda t: (t.example_index, t.rollout_index)):
        if trajectory.example_index not in wanted:
            continue
        for call in trajectory.calls:
            trains = bool(call.completion_ids) and not (
                mask_truncated_completions and call.finish_reason == "length"
            )
            for group, member, advantage in places.get(id(call), [(None, None, None)]):
                records.append(
                    {
                        "step": step,
                        "example": trajectory.example_index,
                        "rollout": trajectory.rollout_index,
                        "module": call.predictor,
                        "invocation": call.invocation,
                        "group": group,
                        "member": member,
                        "reward": trajectory.reward,
                        "advantage": advantage,
                        "trained": group is not None and trains,
                        "status": trajectory.status,
                        "finish_reason": call.finish_reason,
                        "replayed": call.replayed,
                        "prompt": [dict(message) for message in call.messages],
                        "reply": call.completion,
                    }
                )
    return records


def read_samples(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run folder's samples.jsonl (a line cut short by a kill is dropped, as `read_rows` does)."""
    path = Path(run_dir) / SAMPLES_FILE
    if not path.is_file():
        raise UserError(
            f"{path} does not exist: a run writes it from its first step "
            "(samples_per_step > 0, or -1 for every example)"
        )
    return read_rows(path)


def _text(value: Any, width: int) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def print_step(records: Sequence[Mapping[str, Any]], step: int | None, out: TextIO) -> int:
    """One step's groups (the last logged step when `step` is None), readable: per group its
    module and invocation, the prompt of its first member, then a line per member."""
    steps = sorted({r["step"] for r in records})
    if not steps:
        raise UserError("samples.jsonl holds no records yet")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise UserError(f"no samples of step {step}; the steps logged: {steps[0]}..{steps[-1]}")
    mine = [r for r in records if r["step"] == step]
    print(f"step {step}: {len({r['example'] for r in mine})} example(s)", file=out)
    grouped: dict[int, list[Mapping[str, Any]]] = {}
    for record in mine:
        if record["group"] is not None:
            grouped.setdefault(record["group"], []).append(record)
    for group, members in sorted(grouped.items()):
        first = members[0]
        invocation = "" if first["invocation"] is None else f"[{first['invocation']}]"
        rewards = [m["reward"] for m in members]
        print(
            f"\nexample {first['example']}, group {group}: {first['module']}{invocation}, "
            f"{len(members)} members, rewards {min(rewards):.3f}..{max(rewards):.3f}",
            file=out,
        )
        prompt = first["prompt"][-1]["content"] if first["prompt"] else ""
        print(f"  prompt: {_text(prompt, 110)}", file=out)
        for m in sorted(members, key=lambda m: m["member"]):
            mark = "trained" if m["trained"] else "not trained"
            print(
                f"  rollout {m['rollout']:>2}  reward {_number(m['reward'])}  advantage "
                f"{_number(m['advantage'])}  {mark:<11}  {_text(m['reply'], 60)!r}",
                file=out,
            )
    alone = [r for r in mine if r["group"] is None]
    if alone:
        print(f"\n{len(alone)} call(s) in no group (nothing trained on them):", file=out)
        for r in alone:
            print(
                f"  example {r['example']} rollout {r['rollout']} {r['module']}"
                f"[{r['invocation']}]: {_text(r['reply'], 60)!r}",
                file=out,
            )
    return 0
