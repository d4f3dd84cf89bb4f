"""A stand-in for `mmgrpo demo` in the sweep runner's tests: seconds instead of minutes.

It takes the demo's override keys, logs a deterministic curve of (seed, lr) to metrics.jsonl, a
"checkpoint" after every step, and resumes from it the way the trainer does (rows after the
checkpoint dropped), so an interrupted run ends with the files of an uninterrupted one.
`fail=<code>` exits with that code instead (after printing a last line); FAKE_STEP_SECONDS sets
the time a step takes. Given better-together's `strategy`, a lone p stage saves a prompt state,
a `prompt_stage=` file is read into the summary, and the start stage's scores are made up from
the seed or read from a `start_scores=` file.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

# sweep/child.py itself, without importing the mmgrpo_jax package (seconds of JAX imports)
_CHILD = Path(__file__).resolve().parents[2] / "mmgrpo_jax" / "sweep" / "child.py"
_spec = importlib.util.spec_from_file_location("sweep_child", _CHILD)
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)


def curve_value(seed: int, lr: float, step: int) -> float:
    return round(min(1.0, step * lr * 100 + 0.05 * (seed % 3)), 6)


def main(argv: list[str]) -> int:
    child.die_with_parent()
    args = dict(a.split("=", 1) for a in argv)
    if "fail" in args:
        print(f"fake run: failing on purpose with {args['fail']}", file=sys.stderr)
        return int(args["fail"])
    run_dir = Path(args.get("run_dir") or args["mmgrpo.run_dir"])  # demo's keys or the trainer's
    seed = int(args.get("seed") or args["mmgrpo.seed"])
    lr, steps = float(args.get("lr", "0.002")), int(args.get("num_steps", "6"))
    delay = float(os.environ.get("FAKE_STEP_SECONDS", "0.1"))
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "run.lock").open("a") as lock:  # the trainer's lock, without its imports
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        checkpoint, metrics = run_dir / "ckpt.json", run_dir / "metrics.jsonl"
        done = json.loads(checkpoint.read_text())["step"] if checkpoint.is_file() else 0
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if done else []
        rows = [r for r in rows if r["step"] <= done]
        metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
        start = time.monotonic()
        for step in range(done + 1, steps + 1):
            time.sleep(delay)
            with metrics.open("a") as f:
                f.write(json.dumps({"step": step, "eval_reward": curve_value(seed, lr, step)}))
                f.write("\n")
            partial = run_dir / "ckpt.partial"
            partial.write_text(json.dumps({"step": step}))
            partial.replace(checkpoint)
        summary = {
            "eval_reward_after": curve_value(seed, lr, steps),
            "wall_seconds": time.monotonic() - start,
        }
        if "strategy" in args:  # better-together's: a p stage saves prompts, a loaded one is read
            summary["strategy"] = args["strategy"]
            summary["prompt_stage"] = args.get("prompt_stage")
            if "prompt_stage" in args:
                summary["loaded"] = json.loads(Path(args["prompt_stage"]).read_text())
            summary["stages"] = [{"stage": "start", "valset": 0.1 + seed, "test": 0.2 + seed}]
            if "start_scores" in args:  # read, as better-together reads it
                summary["start_scores"] = args["start_scores"]
                summary["stages"] = json.loads(Path(args["start_scores"]).read_text())["stages"]
            if args["strategy"] == "p":
                (run_dir / "prompts").mkdir(exist_ok=True)
                state = {"searched": {"seed": seed, "at": time.time()}}
                (run_dir / "prompts" / "prompt_state.json").write_text(json.dumps(state))
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
