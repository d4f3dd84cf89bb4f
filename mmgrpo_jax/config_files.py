"""Configuration front end: a frozen dataclass, filled from a YAML file, then `key=value` overrides.

Nested dataclasses are addressed with dotted keys (``loss.variant=dapo``). Values are read as YAML
scalars, so ``3``, ``0.5``, ``1e-5``, ``true`` and ``null`` get their natural types (numbers as
YAML 1.2 reads them: YAML 1.1 would take ``1e-5`` for a string); the dataclass's own
`__post_init__` then validates them. Unknown keys are errors that list the valid ones.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from mmgrpo_jax.errors import check_type, field_hints

C = TypeVar("C")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: an exponent without a dot (``1e-5``) is a number."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where} is not valid YAML: {problem}{at}") from None


def _build(cls: type[C], values: Mapping[str, Any], where: str) -> C:
    if not isinstance(values, Mapping):
        raise ValueError(f"{where or 'config'} must be a mapping, got {values!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        guesses = [g for k in unknown for g in difflib.get_close_matches(k, fields, n=1)]
        hint = f" (did you mean {[where + g for g in guesses]}?)" if guesses else ""
        raise ValueError(
            f"unknown {cls.__name__} keys {[where + k for k in unknown]}{hint}; "
            f"valid: {[where + k for k in sorted(fields)]}"
        )
    hints = field_hints(cls)
    kwargs = {}
    for name, value in values.items():
        nested = hints[name]
        if isinstance(value, Mapping) and not dataclasses.is_dataclass(nested):
            raise ValueError(f"{where}{name!r} is not a section; got {dict(value)!r}")
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            base = _default(fields[name])
            if isinstance(value, nested):
                value = _fields(value)
            if base is not None and isinstance(value, Mapping):
                value = {**_fields(base), **value}
            value = _build(nested, value, f"{where}{name}.")
        else:
            check_type(nested, value, where + name)
        kwargs[name] = value
    return cls(**kwargs)


def _fields(instance: Any) -> dict[str, Any]:
    """A dataclass as a (shallow) tree, nested dataclasses as mappings: the shape of a file."""
    return {
        f.name: _fields(v) if dataclasses.is_dataclass(v := getattr(instance, f.name)) else v
        for f in dataclasses.fields(instance)
    }


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {part!r} is not a section")
        tree = node
    tree[leaf] = value


def config_keys(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    """Every key of a config class as `key=value` takes it (nested sections dotted) with its
    default: the reference `--help` prints, read from the dataclasses themselves."""
    hints = field_hints(cls)
    keys: list[tuple[str, Any]] = []
    for field in dataclasses.fields(cls):
        default = _default(field)
        nested = hints[field.name]
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            keys += config_keys(nested, f"{prefix}{field.name}.")
            if default is not None:  # a section whose default differs from its class's
                values = dict(_flatten_fields(_fields(default), f"{prefix}{field.name}."))
                keys = [(k, values.get(k, v)) for k, v in keys]
            continue
        required = field.default is dataclasses.MISSING and field.default_factory is (
            dataclasses.MISSING
        )
        keys.append((prefix + field.name, "(required)" if required else default))
    return keys


def _flatten_fields(tree: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            items += _flatten_fields(value, f"{prefix}{key}.")
        else:
            items.append((prefix + key, value))
    return items


def read_yaml(path: str | Path) -> Any:
    """A YAML file read the way configs are (YAML 1.2 numbers, no arbitrary objects)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    return _parse(path.read_text(), f"config file {str(path)!r}")


def config_tree(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """An optional YAML file's mapping with ``key=value`` overrides on top (not yet validated)."""
    tree: dict[str, Any] = {} if path is None else read_yaml(path) or {}
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ValueError(f"override {override!r} must look like key=value")
        _set_dotted(tree, key.strip(), _parse(raw, f"override {override!r}"))
    return tree


def build_config(cls: type[C], tree: Mapping[str, Any], where: str = "") -> C:
    """`cls` from a mapping (nested sections for nested dataclasses); unknown keys are errors."""
    return _build(cls, tree, where)


def load_config(cls: type[C], path: str | Path | None = None, overrides: Sequence[str] = ()) -> C:
    """`cls` from an optional YAML file, then ``key=value`` overrides on top."""
    return _build(cls, config_tree(path, overrides), "")


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def setting(
    default: Any = dataclasses.MISSING,
    note: str = "",
    *,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A config field and what it is for, kept as `metadata["help"]` (TRL's convention, shorter
    to write): the one text `--help`, the CLI reference and `field_notes` read, and the API
    pages show (griffe-fieldz reads the same note as `metadata["description"]`)."""
    metadata = {"help": note, "description": note} if note else {}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def field_notes(cls: type) -> dict[str, str]:
    """What each field of a config class is for: its `metadata["help"]` (see `setting`)."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(cls) if "help" in f.metadata}


def key_notes(cls: type, prefix: str = "") -> dict[str, str]:
    """`field_notes` for every key `config_keys` lists, nested sections dotted."""
    notes = {prefix + name: text for name, text in field_notes(cls).items()}
    hints = field_hints(cls)
    for field in dataclasses.fields(cls):
        nested = hints[field.name]
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            notes.update(key_notes(nested, f"{prefix}{field.name}."))
    return notes
