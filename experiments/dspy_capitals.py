"""The capitals program written in DSPy, trained on SmolLM2-135M through the DSPy bridge.

The real-LM tier's program (programs/capitals.py) as an unmodified `dspy.Module` with
`BareAdapter` (its prompts are the native bare predictors' byte for byte), scored greedily on the
test split before and after `MMGRPO.compile` trains it with Table 1's weight-stage setting
(experiments/sweeps/capitals_table1.yaml). Both times the native program is scored on the same
policy too: the two must agree example for example. With `--compare <run>/metrics.jsonl` (a native
run of the same setting, e.g. the Table 1 sweep's method-mmgrpo/seed0 run, made with
single-threaded XLA as this script's sweep children are) the steps' losses and rewards are set
side by side.

    mmgrpo models fetch smollm2-135m
    XLA_FLAGS=--xla_cpu_multi_thread_eigen=false python experiments/dspy_capitals.py --steps 5 \\
        --compare experiments/results/capitals_table1/runs/method-mmgrpo/seed0/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dspy

from mmgrpo_jax.config_files import build_config, config_tree
from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.interop.dspy import BareAdapter, DSPyProgram, dspy_metric, from_dspy_examples
from mmgrpo_jax.rl.rollout import score_examples
from mmgrpo_jax.trainer.config import MMGRPOConfig
from mmgrpo_jax.trainer.mmgrpo import MMGRPO
from programs.capitals import Capitals, capital_match, load_capitals

CONFIG = Path(__file__).parent / "configs" / "capitals_smollm2.yaml"
TABLE1 = ["optim.lr=3.0e-4", "loss.beta=0.04", "eval_every=5", "checkpoint_every=5"]


class DSPyCapitals(dspy.Module):
    """programs/capitals.py's Capitals, in DSPy."""

    def __init__(self) -> None:
        super().__init__()
        self.country = dspy.Predict(
            dspy.Signature("question -> country", "Name the country that the question asks about.")
        )
        self.capital = dspy.Predict(
            dspy.Signature(
                "country -> capital",
                "Name the capital city of the country. Reply with the city name only.",
            )
        )

    def forward(self, question: str) -> dspy.Prediction:
        country = self.country(question=question).country
        return self.capital(country=country)


def metric(example: dspy.Example, pred: dspy.Prediction, trace: object = None) -> float:
    return capital_match(example, pred)


def as_dspy(examples: list) -> list[dspy.Example]:
    return [dspy.Example(**dict(e)).with_inputs(*e.input_keys) for e in examples]


def score_both(trainer: MMGRPO, test: list) -> dict[str, object]:
    """Greedy test scores of the DSPy program (through the bridge) and the native one."""
    s = trainer.config.sampler
    lm = EngineLM.local(
        trainer.model,
        trainer.tokenizer,
        sampling=Sampling(s.max_completion_tokens, temperature=0.0),
        stop_token_ids=trainer.stop_token_ids,
    )
    try:
        with dspy.context(adapter=BareAdapter()):
            bridged = DSPyProgram(DSPyCapitals())
        ours = score_examples(
            bridged, from_dspy_examples(as_dspy(test)), dspy_metric(metric), lm=lm
        )
        native = score_examples(Capitals(), test, capital_match, lm=lm)
    finally:
        lm.close()
    replies = [
        (t.calls[-1].completion if t.calls else None, n.calls[-1].completion if n.calls else None)
        for t, n in zip(ours, native, strict=True)
    ]
    return {
        "dspy": sum(t.reward for t in ours) / len(ours),
        "native": sum(t.reward for t in native) / len(native),
        "same_replies": sum(a == b for a, b in replies),
        "examples": len(replies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/dspy_capitals")
    parser.add_argument("--compare", help="a native run's metrics.jsonl, same setting")
    args = parser.parse_args()

    tree = config_tree(
        CONFIG,
        [f"mmgrpo.{o}" for o in TABLE1]
        + [f"mmgrpo.num_steps={args.steps}", f"mmgrpo.seed={args.seed}"]
        + [f"mmgrpo.run_dir={args.run_dir}"],
    )
    cfg = build_config(MMGRPOConfig, tree["mmgrpo"], "mmgrpo")
    splits = load_capitals(seed=args.seed)
    trainer = MMGRPO(metric, cfg)
    start = time.perf_counter()
    before = score_both(trainer, splits.test)
    with dspy.context(adapter=BareAdapter()):
        trained = trainer.compile(DSPyCapitals(), as_dspy(splits.train), as_dspy(splits.dev))
    after = score_both(trainer, splits.test)
    with dspy.context(adapter=BareAdapter()):
        example = splits.test[0]
        reply = trained(question=example.question).capital
    trained.capital.lm.close()
    steps = [json.loads(x) for x in (Path(args.run_dir) / "metrics.jsonl").read_text().splitlines()]
    result = {
        "test_before": before,
        "test_after": after,
        "trained_program_reply": {"question": example.question, "capital": reply},
        "steps": [
            {k: r[k] for k in ("step", "loss", "reward_mean", "grad_norm") if k in r}
            for r in steps
            if "loss" in r
        ],
        "eval_reward": [(r["step"], r["eval_reward"]) for r in steps if "eval_reward" in r],
        "wall_seconds": time.perf_counter() - start,
    }
    if args.compare:
        native = [json.loads(x) for x in Path(args.compare).read_text().splitlines()]
        result["native_steps"] = [
            {k: r[k] for k in ("step", "loss", "reward_mean", "grad_norm") if k in r}
            for r in native
            if "loss" in r and r["step"] <= args.steps
        ]
    print(json.dumps(result, indent=2))
    (Path(args.run_dir) / "dspy_capitals.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
