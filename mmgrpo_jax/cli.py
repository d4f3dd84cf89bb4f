"""`mmgrpo` command line: pick a subcommand and a config file, override fields, nothing else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mmgrpo_jax.config import load_config


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
    args = parser.parse_args(argv)

    if args.command == "demo":
        from mmgrpo_jax import demo as module

        config_cls = module.DemoConfig
        overrides = [*args.overrides, *([f"grouping={args.grouping}"] if args.grouping else [])]
    elif args.command == "groups":
        from mmgrpo_jax import groups_demo as module

        config_cls, overrides = module.GroupsDemoConfig, args.overrides
    else:
        raise AssertionError(f"unhandled command {args.command!r}")
    try:
        config = load_config(config_cls, args.config, overrides)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    return module.main(config, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
