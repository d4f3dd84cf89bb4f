"""The documentation's CLI reference, generated from the parser and the config dataclasses so
that no command, option, key or default is written twice (docs/hooks.py puts it in the site)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize

from mmgrpo_jax.cli import build_parser, command_config_class, shown_default
from mmgrpo_jax.config_files import config_keys
from mmgrpo_jax.errors import field_hints

WIDTH = 100  # the help text's line width, whatever the terminal


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order `mmgrpo --help` lists."""
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
    return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]


def _usage(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = functools.partial(argparse.HelpFormatter, width=WIDTH)
    return parser.format_help().rstrip()


def field_notes(cls: type) -> dict[str, str]:
    """Each field's comment in the class's source: the comment lines right above it and the one
    at its end, as one sentence (what the reference says a key is for, written once, in code)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, alone on its line)
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0]
            alone = not lines[row - 1][: token.start[1]].strip()
            comments[row] = (token.string.lstrip("#").strip(), alone)
    [classdef] = ast.parse(source).body
    notes = {}
    for node in classdef.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, row = [], node.lineno - 1
        while row in comments and comments[row][1]:
            above.insert(0, comments[row][0])
            row -= 1
        trailing = [
            comments[r][0]
            for r in range(node.lineno, node.end_lineno + 1)
            if r in comments and not comments[r][1]
        ]
        text = " ".join([*above, *trailing]).strip()
        if text:
            notes[node.target.id] = text
    return notes


def key_notes(cls: type, prefix: str = "") -> dict[str, str]:
    """`field_notes` for every key `config_keys` lists, nested sections dotted."""
    notes = {prefix + name: text for name, text in field_notes(cls).items()}
    hints = field_hints(cls)
    for field in dataclasses.fields(cls):
        nested = hints[field.name]
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            notes.update(key_notes(nested, f"{prefix}{field.name}."))
    return notes


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
