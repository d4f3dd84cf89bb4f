"""`mmgrpo` command line: pick a subcommand and a config file, override fields, nothing else.

Exit codes: 0 done; 2 a user error (a bad value, path or run directory: one line on stderr, no
traceback); 130 / 143 stopped by SIGINT / SIGTERM (training writes the checkpoint of the last
completed step first). Any other failure is a bug and shows its full traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import Sequence

from mmgrpo_jax.cli.config import load_config
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.trainer.interrupt import Interrupted, StopSignals, exit_code
from models.config import CheckpointError


def _config_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--config", help=f"YAML file with {what} fields")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="field overrides")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmgrpo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="train a tiny policy from scratch on the two-door program with mmGRPO"
    )
    demo.add_argument("--grouping", choices=("module", "trajectory"), help="the objective")
    _config_arguments(demo, "DemoConfig")
    groups = commands.add_parser(
        "groups", help="scripted rollouts of the synthetic program and the groups formed from them"
    )
    _config_arguments(groups, "GroupsDemoConfig")
    train = commands.add_parser(
        "train", help="mmGRPO on a paper task from a local checkpoint (experiments/configs/)"
    )
    _config_arguments(train, "ExperimentConfig")
    prompts = commands.add_parser(
        "optimize-prompts",
        help="MIPROv2 instructions and demos for a paper task (same configs as train)",
    )
    prompts.add_argument(
        "--dry-run",
        action="store_true",
        help="print the budget (program runs, prompt-model calls) and stop",
    )
    _config_arguments(prompts, "ExperimentConfig")
    together = commands.add_parser(
        "better-together",
        help="prompt and weight optimization in the order of `strategy` (same configs as train)",
    )
    _config_arguments(together, "ExperimentConfig")
    evaluate = commands.add_parser(
        "eval", help="greedy evaluation of a checkpoint (and adapter) on a task split"
    )
    evaluate.add_argument("--program", help="banking77 | papillon | hover (task.name)")
    evaluate.add_argument("--model", help="local HF checkpoint directory (model_path)")
    evaluate.add_argument("--adapter", help="PEFT adapter directory (adapter_path)")
    evaluate.add_argument("--split", help="train | dev | test")
    evaluate.add_argument("--limit", help="first N examples of the split")
    evaluate.add_argument("--out", help="predictions JSONL path")
    _config_arguments(evaluate, "EvalConfig")
    # key=value overrides may come before, between or after the options
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]

    if args.command == "demo":
        from mmgrpo_jax.cli import demo as module

        config_cls, run = module.DemoConfig, module.main
        overrides = [*args.overrides, *([f"grouping={args.grouping}"] if args.grouping else [])]
    elif args.command == "groups":
        from mmgrpo_jax.cli import groups_demo as module

        config_cls, run, overrides = module.GroupsDemoConfig, module.main, args.overrides
    elif args.command in ("train", "optimize-prompts", "better-together", "eval"):
        from mmgrpo_jax.cli import experiment as module

        config_cls = module.EvalConfig if args.command == "eval" else module.ExperimentConfig
        options = {"dry_run": True} if getattr(args, "dry_run", False) else {}
        run = functools.partial(module.main, args.command, **options)
        flags = {
            "program": "task.name",
            "model": "model_path",
            "adapter": "adapter_path",
            "split": "split",
            "limit": "limit",
            "out": "out",
        }
        given = [
            f"{key}={getattr(args, flag)}"
            for flag, key in flags.items()
            if getattr(args, flag, None) is not None
        ]
        overrides = [*args.overrides, *given]
    else:
        raise AssertionError(f"unhandled command {args.command!r}")
    try:
        config = load_config(config_cls, args.config, overrides)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    try:
        # SIGTERM stops any command the way Ctrl-C does; training nests its own StopSignals,
        # which hold a signal back while an update or a checkpoint write runs
        with StopSignals():
            return run(config, sys.stdout)
    # a value, a path, a run directory or a machine, not a bug: one line, no traceback
    except (UserError, CheckpointError, FileNotFoundError, MemoryError) as err:
        print(f"mmgrpo {args.command}: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        why = err.signal_name if isinstance(err, Interrupted) else "SIGINT"
        notes = "; ".join(getattr(err, "__notes__", ()))
        print(
            f"mmgrpo {args.command}: stopped by {why}{'; ' + notes if notes else ''}",
            file=sys.stderr,
        )
        return exit_code(err)


def entry() -> None:
    """The `mmgrpo` executable. After a stop signal it leaves at once: a rollout thread still
    blocked in a remote LM call must not keep the process alive once the checkpoint is written."""
    code = main()
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())

if __name__ == "__main__":
    entry()
