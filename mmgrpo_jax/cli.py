"""`mmgrpo` command line: pick a subcommand and a config file, override fields, nothing else."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mmgrpo_jax.config import load_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mmgrpo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="rollouts of the synthetic program, then module-level groups and advantages"
    )
    demo.add_argument("--config", help="YAML file with DemoConfig fields")
    demo.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. num_rollouts=8")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from mmgrpo_jax import demo as demo_module

        try:
            config = load_config(demo_module.DemoConfig, args.config, args.overrides)
        except (ValueError, FileNotFoundError) as err:
            parser.error(str(err))
        return demo_module.main(config, sys.stdout)
    raise AssertionError(f"unhandled command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
