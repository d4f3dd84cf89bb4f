"""Module- vs trajectory-level mmGRPO, and grpo / dapo / cispo, on the two-door demo program.

Each (grouping, loss, seed) trains the demo's tiny from-scratch policy (`mmgrpo_jax.cli.demo`) and
its greedy eval curve is read back from metrics.jsonl. Writes under --out (default
experiments/results/): grouping_ablation.md (final eval reward mean and std over seeds, and the
first step at which eval reached 0.7, per seed), grouping_ablation.csv (every run) and
grouping_ablation.png (mean curves with min-max bands).

    python experiments/grouping_ablation.py                 # 2 x 3 x 3 runs, ~3 min each on 2 cores
    python experiments/grouping_ablation.py --seeds 0 --steps 60 --losses grpo   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np

from mmgrpo_jax.cli.demo import DemoConfig, run_demo
from mmgrpo_jax.rl.rollout import quiet_failure_warnings

# The clip settings each variant's paper uses: DAPO's clip-higher, CISPO's absolute weight cap.
LOSSES = {"grpo": None, "dapo": 0.28, "cispo": 5.0}
TARGET = 0.7


@dataclasses.dataclass
class Run:
    grouping: str
    loss: str
    seed: int
    steps: list[int]
    rewards: list[float]
    wall_seconds: float

    @property
    def final(self) -> float:
        return self.rewards[-1]

    @property
    def steps_to_target(self) -> int | None:
        return next((s for s, r in zip(self.steps, self.rewards, strict=True) if r >= TARGET), None)


def train(grouping: str, loss: str, seed: int, steps: int, run_root: Path) -> Run:
    run_dir = run_root / f"{grouping}-{loss}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a sweep's run folders are its own scratch
    config = DemoConfig(
        grouping=grouping,
        loss=loss,
        epsilon_high=LOSSES[loss],
        seed=seed,
        num_steps=steps,
        run_dir=str(run_dir),
        progress=False,
    )
    with quiet_failure_warnings():
        summary = run_demo(config)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(int(r["step"]), r["eval_reward"]) for r in records if "eval_reward" in r]
    return Run(grouping, loss, seed, *map(list, zip(*curve, strict=True)), summary["wall_seconds"])


def table(runs: list[Run], groupings: list[str], losses: list[str]) -> str:
    lines = [
        "| grouping | loss | final eval reward (mean ± std) | steps to 0.7 per seed | runs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for grouping in groupings:
        for loss in losses:
            cell = [r for r in runs if r.grouping == grouping and r.loss == loss]
            if not cell:
                continue
            finals = np.array([r.final for r in cell])
            reached = ", ".join(
                "never" if r.steps_to_target is None else str(r.steps_to_target) for r in cell
            )
            lines.append(
                f"| {grouping} | {loss} | {finals.mean():.2f} ± {finals.std(ddof=0):.2f} | "
                f"{reached} | {len(cell)} |"
            )
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], groupings: list[str], losses: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groupings), figsize=(5 * len(groupings), 3.8), sharey=True)
    for ax, grouping in zip(np.atleast_1d(axes), groupings, strict=True):
        for loss in losses:
            cell = [r for r in runs if r.grouping == grouping and r.loss == loss]
            if not cell:
                continue
            steps = cell[0].steps
            curves = np.array([r.rewards for r in cell])
            ax.plot(steps, curves.mean(0), label=f"{loss} (n={len(cell)})")
            ax.fill_between(steps, curves.min(0), curves.max(0), alpha=0.15)
        ax.axhline(TARGET, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{grouping}-level mmGRPO", xlabel="step", ylim=(-0.05, 1.05))
        ax.legend(loc="lower right")
    np.atleast_1d(axes)[0].set_ylabel("greedy eval reward")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groupings", nargs="+", default=["module", "trajectory"])
    parser.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=DemoConfig.num_steps)
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for grouping in args.groupings:
        for loss in args.losses:
            for seed in args.seeds:
                run = train(grouping, loss, seed, args.steps, args.out / "grouping_ablation_runs")
                print(
                    f"{grouping:10s} {loss:6s} seed {seed}: final {run.final:.2f}, "
                    f"steps to {TARGET}: {run.steps_to_target}, {run.wall_seconds:.0f} s",
                    flush=True,
                )
                runs.append(run)
                write_results(runs, args)  # after every run: an interrupted sweep keeps its table
    print(table(runs, args.groupings, args.losses))


def write_results(runs: list[Run], args: argparse.Namespace) -> None:
    with (args.out / "grouping_ablation.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["grouping", "loss", "seed", "final", "steps_to_0.7", "wall_seconds"])
        for r in runs:
            writer.writerow(
                [r.grouping, r.loss, r.seed, r.final, r.steps_to_target, round(r.wall_seconds)]
            )
    groupings = [g for g in args.groupings if any(r.grouping == g for r in runs)]
    losses = [x for x in args.losses if any(r.loss == x for r in runs)]
    header = (
        f"# Grouping ablation on the two-door program ({args.steps} steps, seeds {args.seeds})\n\n"
        "Greedy eval reward on the 4 validation clues, every 10 steps (`mmgrpo_jax.cli.demo`).\n\n"
    )
    (args.out / "grouping_ablation.md").write_text(header + table(runs, groupings, losses))
    plot(runs, groupings, losses, args.out / "grouping_ablation.png")


if __name__ == "__main__":
    main()
