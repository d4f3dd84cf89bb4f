"""Table 1 at CPU scale: vanilla, prompt optimization, mmGRPO and BetterTogether, 3 seeds.

The paper's Table 1 compares, per task and model, the program as written (vanilla), MIPROv2
prompt optimization, mmGRPO and BetterTogether (MIPROv2, then mmGRPO on the frozen prompts).
This script runs the same four on one program with the same code paths as the real tasks
(`MIPROv2`, `MMGRPO`, `BetterTogether`). Without a GPU, the program is the two-door demo
(`programs.synthetic.TwoDoors`) and the policy the demo's tiny from-scratch decoder
(`mmgrpo_jax.cli.demo.tiny_policy`, one fresh initialisation per seed); the prompt model is
scripted: a seeded function of its prompt that writes instructions from the task's words (the
only words the tiny policy's vocabulary has). The two-door task has 4 distinct inputs, so train,
validation and test are the same 4 clues: the table measures optimization, not generalization.

Writes under --out (default experiments/results/): table1.md (mean ± std over seeds and every
seed's score), table1.csv (one row per method and seed) and table1.png (bars with seed dots),
rewritten after every run so an interrupted sweep keeps its table.

    python experiments/table1.py                                # 3 seeds, ~25 min on 2 cores
    python experiments/table1.py --seeds 0 --steps 4 --out /tmp/t1   # a smoke run
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmgrpo_jax.cli.demo import DemoConfig, mmgrpo_config, tiny_policy
from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.prompt_opt.better_together import BetterTogether
from mmgrpo_jax.prompt_opt.mipro import MIPROv2, PromptOptConfig
from mmgrpo_jax.prompt_opt.proposer import PROPOSE, SUMMARIZE
from mmgrpo_jax.rl.rollout import quiet_failure_warnings
from mmgrpo_jax.testing import ScriptedLM
from mmgrpo_jax.trainer.mmgrpo import MMGRPO, default_engine, evaluate
from programs import synthetic

METHODS = ("vanilla", "prompt_opt", "mmgrpo", "better_together")
LABELS = {
    "vanilla": "Vanilla",
    "prompt_opt": "Prompt opt. (MIPROv2)",
    "mmgrpo": "mmGRPO",
    "better_together": "BetterTogether",
}
WORDS = (*synthetic.SIGN_WORDS, *synthetic.DOORS)


@dataclasses.dataclass
class Result:
    method: str
    seed: int
    score: float  # greedy test reward
    wall_seconds: float
    detail: str = ""  # BetterTogether: the stage it returned and every stage's valset score


def scripted_prompt_model(seed: int) -> ScriptedLM:
    """Summaries are a fixed sentence; instructions are 3-8 task words drawn from a generator
    seeded by the prompt itself, so different tips and demo sets give different candidates."""

    def respond(messages) -> str:
        content = messages[-1]["content"]
        if "[[ ## examples ## ]]" in content:
            return format_outputs(SUMMARIZE, {"observations": "Clues are words; answers too."})
        rng = random.Random(f"{seed}/{content}")
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        return format_outputs(PROPOSE, {"proposed_instruction": " ".join(words)})

    return ScriptedLM(respond)


class Setup:
    """One seed's fresh policy, its engine (mmGRPO trains through it, the greedy LM scores on
    it: both see the latest weights), the data, and the optimizers built on them."""

    def __init__(self, method: str, seed: int, args: argparse.Namespace) -> None:
        self.demo = DemoConfig(seed=seed, num_steps=args.steps, progress=False)
        self.model, self.tokenizer = tiny_policy(self.demo)
        self.stop = [self.tokenizer.eos_token_id]
        self.engine = default_engine(self.model, self.stop, mmgrpo_config(self.demo, args.out))
        self.greedy = EngineLM(self.engine, self.tokenizer, sampling=Sampling(1, temperature=0.0))
        self.seed, self.candidates = seed, args.candidates
        self.run_dir = args.out / f"{args.name}_runs"
        self.trainset = synthetic.two_door_examples(repeats=4)
        self.valset = self.testset = synthetic.two_door_examples()
        if args.warmup_steps:
            # The starting policy of every method: a few mmGRPO steps in, so that it parses
            # some of the time (a stand-in for a pretrained model's format-following).
            warmup = self.weight_optimizer(f"warmup-{method}", steps=args.warmup_steps)
            warmup.compile(synthetic.TwoDoors(), self.trainset)

    def score(self, program: Module, examples=None) -> float:
        examples = self.testset if examples is None else examples
        return evaluate(program, examples, synthetic.two_door_metric, self.greedy)

    def prompt_optimizer(self) -> MIPROv2:
        config = PromptOptConfig(
            auto=None,
            num_candidates=self.candidates,
            bootstrap_pool=len(self.trainset),
            seed=self.seed,
        )
        return MIPROv2(
            synthetic.two_door_metric,
            config,
            prompt_lm=scripted_prompt_model(self.seed),
            lm=self.greedy,
        )

    def weight_optimizer(self, name: str, steps: int | None = None) -> MMGRPO:
        """mmGRPO with the demo's settings; `steps` overrides its step count."""
        run_dir = self.run_dir / f"{name}-seed{self.seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # a sweep's run folders are its own scratch
        demo = self.demo if steps is None else dataclasses.replace(self.demo, num_steps=steps)
        return MMGRPO(
            synthetic.two_door_metric,
            mmgrpo_config(demo, run_dir),
            model=self.model,
            tokenizer=self.tokenizer,
            stop_token_ids=self.stop,
            engine=self.engine,
        )

    def close(self) -> None:
        self.engine.close()


def vanilla(setup: Setup) -> tuple[Module, str]:
    return synthetic.TwoDoors(), ""


def prompt_opt(setup: Setup) -> tuple[Module, str]:
    program = setup.prompt_optimizer().compile(synthetic.TwoDoors(), setup.trainset, setup.valset)
    return program, ""


def mmgrpo(setup: Setup) -> tuple[Module, str]:
    optimizer = setup.weight_optimizer("mmgrpo")
    return optimizer.compile(synthetic.TwoDoors(), setup.trainset, setup.valset), ""


def better_together(setup: Setup) -> tuple[Module, str]:
    together = BetterTogether(
        lambda program, examples: setup.score(program, examples),
        setup.prompt_optimizer(),
        setup.weight_optimizer("better_together"),
        seed=setup.seed,
    )
    program = together.compile(synthetic.TwoDoors(), setup.trainset, setup.valset, "p -> w")
    best = max(together.stages, key=lambda s: s.score)
    stages = ", ".join(f"{s.name} {s.score:.2f}" for s in together.stages)
    return program, f"returned stage {best.name} (valset: {stages})"


RUNNERS: dict[str, Callable[[Setup], tuple[Module, str]]] = {
    "vanilla": vanilla,
    "prompt_opt": prompt_opt,
    "mmgrpo": mmgrpo,
    "better_together": better_together,
}


def run(method: str, seed: int, args: argparse.Namespace) -> Result:
    with quiet_failure_warnings():  # a random policy's parse failures are expected
        setup = Setup(method, seed, args)  # warm-up steps, if any, happen here
        start = time.perf_counter()
        try:
            program, detail = RUNNERS[method](setup)
            score = setup.score(program)
        finally:
            setup.close()
    return Result(method, seed, score, time.perf_counter() - start, detail)


def table(results: list[Result]) -> str:
    lines = ["| method | test reward (mean ± std) | per seed |", "| --- | --- | --- |"]
    for method in METHODS:
        cell = [r for r in results if r.method == method]
        if not cell:
            continue
        scores = np.array([r.score for r in cell])
        per_seed = ", ".join(f"{r.score:.2f} (seed {r.seed})" for r in cell)
        lines.append(
            f"| {LABELS[method]} | {scores.mean():.2f} ± {scores.std(ddof=0):.2f} | {per_seed} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if any(r.method == m for r in results)]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for x, method in enumerate(methods):
        scores = np.array([r.score for r in results if r.method == method])
        ax.bar(x, scores.mean(), yerr=scores.std(ddof=0), capsize=4, alpha=0.7)
        ax.scatter(np.full(len(scores), x), scores, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(methods)), [LABELS[m] for m in methods], fontsize=8)
    ax.set(ylabel="greedy test reward", ylim=(0, 1.05), title="Two-door program, tiny policy")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(results: list[Result], args: argparse.Namespace) -> None:
    with (args.out / f"{args.name}.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "seed", "test_reward", "wall_seconds", "detail"])
        for r in results:
            writer.writerow([r.method, r.seed, r.score, round(r.wall_seconds), r.detail])
    start = f", every method starting {args.warmup_steps} mmGRPO steps in" * bool(args.warmup_steps)
    header = (
        f"# Table 1 at CPU scale: the two-door program ({args.steps} mmGRPO steps, "
        f"{args.candidates} prompt candidates, seeds {args.seeds}{start})\n\n"
        "Greedy reward on the 4 clues (train = validation = test: the task has no other "
        "inputs). Written by `experiments/table1.py`; see its docstring for the setup.\n\n"
    )
    notes = [f"- {r.method} seed {r.seed}: {r.detail}" for r in results if r.detail]
    body = table(results) + ("\n" + "\n".join(notes) + "\n" if notes else "")
    (args.out / f"{args.name}.md").write_text(header + body)
    plot(results, args.out / f"{args.name}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=DemoConfig.num_steps)
    parser.add_argument("--candidates", type=int, default=6, help="instructions and demo sets")
    parser.add_argument(
        "--warmup-steps", type=int, default=0, help="mmGRPO steps before every method (0: none)"
    )
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    parser.add_argument("--name", default="table1", help="file names: <name>.md/.csv/.png")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        for method in args.methods:
            result = run(method, seed, args)
            print(
                f"{method:16s} seed {seed}: test {result.score:.2f}, "
                f"{result.wall_seconds:.0f} s {result.detail}",
                flush=True,
            )
            results.append(result)
            write_results(results, args)  # after every run: an interrupted sweep keeps its table
    print(table(results))


if __name__ == "__main__":
    main()
