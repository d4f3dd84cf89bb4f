"""The picture of how calls become groups, drawn from the groups `mmgrpo groups` forms.

Left: the G rollouts of one example, each a row of its LM calls (a module's k-th call is
`module[k]`), with the trajectory's reward. Right: the module-level groups formed from them
(one per module and invocation index, G members, ragged alignment refilling short ones) and
each member's advantage. Every call carries its trajectory's reward into its group.

    .venv/bin/python docs/figures/grouping.py docs/img/grouping.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from mmgrpo_jax.commands.groups_demo import GroupsDemoConfig, run_demo
from mmgrpo_jax.rl.rollout import quiet_failure_warnings

EXAMPLE = 1  # the demo's example whose rollouts make 1, 2 and 3 hops
ARROWS = ("hop", 1)  # the group whose members get arrows: ragged refills its short one
COLORS = {"start": "#4c72b0", "hop": "#dd8452"}


def draw(path: Path) -> None:
    with quiet_failure_warnings():
        result = run_demo(GroupsDemoConfig())
    rollouts = [t for t in result.trajectories if t.example_index == EXAMPLE]
    groups = [
        (g, a)
        for g, a in zip(result.groups, result.advantages, strict=True)
        if g.example_index == EXAMPLE
    ]
    fig = plt.figure(figsize=(12, 4.6))
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    ax.set_xlim(0, 12.2)
    ax.set_ylim(-0.9, len(rollouts) + 0.9)
    ax.axis("off")
    ax.text(0.1, len(rollouts) + 0.5, "G = 4 rollouts of one input", fontsize=11, weight="bold")
    ax.text(6.6, len(rollouts) + 0.5, "module-level groups", fontsize=11, weight="bold")
    call_at = {}
    for row, t in enumerate(rollouts):
        y = len(rollouts) - 1 - row
        ax.text(0.1, y + 0.3, f"rollout {t.rollout_index}", fontsize=9, va="center")
        for i, call in enumerate(t.calls):
            x = 1.0 + i * 0.95
            box = FancyBboxPatch(
                (x, y + 0.05), 0.8, 0.5, boxstyle="round,pad=0.02", fc=COLORS[call.predictor]
            )
            ax.add_patch(box)
            label = f"{call.predictor}[{call.invocation}]"
            ax.text(x + 0.4, y + 0.3, label, color="white", fontsize=8, ha="center", va="center")
            call_at[(t.rollout_index, call.predictor, call.invocation)] = (x + 0.8, y + 0.3)
        ax.text(4.95, y + 0.3, f"reward {t.reward:+.0f}", fontsize=9, va="center")
    width = 5.4 / len(groups)
    for column, (group, advantages) in enumerate(groups):
        x = 6.6 + column * width
        ax.text(
            x + width / 2 - 0.1,
            len(rollouts) + 0.05,
            f"{group.module}[{group.invocation}]",
            fontsize=9,
            ha="center",
            color=COLORS[group.module],
            weight="bold",
        )
        for slot, (member, advantage) in enumerate(zip(group.members, advantages, strict=True)):
            y = len(rollouts) - 1 - slot
            box = FancyBboxPatch(
                (x, y + 0.05),
                width - 0.2,
                0.5,
                boxstyle="round,pad=0.02",
                fc="white",
                ec=COLORS[group.module],
            )
            ax.add_patch(box)
            text = f"r{member.rollout_index}: {member.reward:+.0f}\nA = {advantage:+.2f}"
            ax.text(x + width / 2 - 0.1, y + 0.3, text, fontsize=7.5, ha="center", va="center")
            source = call_at[(member.rollout_index, group.module, member.calls[0].invocation)]
            # one group's arrows; the labels say the rest
            if (group.module, group.invocation) == ARROWS:
                arrow = FancyArrowPatch(
                    source,
                    (x, y + 0.3),
                    arrowstyle="-|>",
                    mutation_scale=8,
                    color=COLORS[group.module],
                    alpha=0.45,
                    connectionstyle="arc3,rad=-0.08",
                )
                ax.add_patch(arrow)
    ax.text(
        0.1,
        -0.75,
        "A member's call carries its trajectory's reward; a group of G members is normalised "
        "on its own (A = (r - mean) / std).\nRagged alignment refills a group from the "
        "rollouts that made the call: hop[1] takes rollout 1 twice; hop[2] has one source, "
        "so no spread, no signal.",
        fontsize=8,
        style="italic",
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img/grouping.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(out)
    print(out)
