"""`mmgrpo` command line: pick a subcommand and a config file, override fields, nothing else."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

from mmgrpo_jax.cli.config import load_config


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
    args = parser.parse_args(argv)

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
        return run(config, sys.stdout)
    except (FileNotFoundError, MemoryError) as err:  # a path or a machine, not a bug: no traceback
        print(f"mmgrpo {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
