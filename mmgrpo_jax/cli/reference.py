"""The documentation's CLI reference, generated from the parser and the config dataclasses so
that no command, option, key or default is written twice (docs/hooks.py puts it in the site)."""

from __future__ import annotations

import argparse
import functools

from mmgrpo_jax.cli import build_parser, command_config_class, shown_default
from mmgrpo_jax.config_files import config_keys, key_notes

WIDTH = 100  # the help text's line width, whatever the terminal


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order `mmgrpo --help` lists."""
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def _usage(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=WIDTH)
    return parser.format_help().rstrip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _keys_table(config_cls: type) -> list[str]:
    notes = key_notes(config_cls)
    rows = ["| key | default | what |", "| --- | --- | --- |"]
    for key, default in config_keys(config_cls):
        shown = _cell(shown_default(default))
        shown = f"`{shown}`" if shown else "(empty)"
        rows.append(f"| `{key}` | {shown} | {_cell(notes.get(key, ''))} |")
    return rows


def cli_reference() -> str:
    """The reference page as markdown: every command's usage and options, then every key it
    takes as `key=value` (or in its --config YAML) with the default."""
    from mmgrpo_jax.sweep.spec import SweepConfig

    lines = [
        "# CLI reference",
        "",
        "Generated from `mmgrpo_jax/cli/__init__.py`'s parser and the config dataclasses by "
        "`mmgrpo_jax.cli.reference` when the site is built; `mmgrpo <command> --help` prints "
        "the same. Keys are given as `key=value` after the command, before or after its "
        "options, or as a YAML mapping in `--config`; nested sections are dotted.",
        "",
    ]
    for name, summary, sub in _subcommands(build_parser()):
        lines += [f"## `mmgrpo {name}`", "", summary, "", "```text", _usage(sub), "```", ""]
        if name == "models":
            for model_command, model_summary, model_parser in _subcommands(sub):
                lines += [
                    f"### `mmgrpo models {model_command}`",
                    "",
                    model_summary,
                    "",
                    "```text",
                    _usage(model_parser),
                    "```",
                    "",
                ]
        if name == "sweep":
            lines += [
                "A sweep file (`--sweep FILE`) holds these keys; the options above override "
                "them, and `key=value` arguments are passed to every run.",
                "",
                *_keys_table(SweepConfig),
                "",
            ]
            continue
        config_cls = command_config_class(name)
        if config_cls is not None:
            lines += [f"Keys (`{config_cls.__name__}`):", "", *_keys_table(config_cls), ""]
    return "\n".join(lines)
