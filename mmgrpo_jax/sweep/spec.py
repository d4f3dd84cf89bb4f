"""What a sweep runs: an `mmgrpo` command, its base config, a grid of cells, and seeds.

A sweep file is YAML with the fields of `SweepConfig`. The grid maps an axis name to its values;
a value is either a scalar (the override ``axis=value``) or a named bundle of overrides, for
settings that go together (a loss and its own clip range)::

    command: demo
    overrides: [num_steps=150]
    grid:
      grouping: [module, trajectory]
      loss:
        grpo: {loss: grpo}
        dapo: {loss: dapo, epsilon_high: 0.28}
    seeds: 0-9
    baseline: {grouping: module, loss: grpo}

The baseline may be another sweep's cell instead (`baseline_from`), when one setting's runs
serve two sweeps: it joins the table as a row of its own, its runs read from that sweep's
folder, never run by this one::

    baseline_from:
      sweep: experiments/sweeps/capitals_study.yaml
      cell: {loss: grpo, grouping: module}
      label: shared   # its value on this sweep's first axis

A better-together sweep whose grid holds both a MIPROv2 cell and a BetterTogether cell runs one
prompt search per seed, not two (`prompt_stage_from`, first-axis values): the BetterTogether run
waits for its MIPROv2 run of the same seed and loads that run's prompts as its p stage::

    grid:
      method:
        prompt_opt: {strategy: p}
        better_together: {strategy: "p -> w"}
    prompt_stage_from: {better_together: prompt_opt}

and with `start_scores_from: vanilla` (the first-axis value whose cell runs `strategy: none`),
every other cell reads its start stage's valset and test scores from the program-as-written
run of the same seed, instead of scoring the same program on the same splits again.

On the command line the same grid is ``--grid "grouping=module,trajectory loss=grpo,dapo"``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mmgrpo_jax.commands import SWEEP_COMMANDS, command_config
from mmgrpo_jax.config_files import read_yaml, setting
from mmgrpo_jax.errors import UserError, check_field_types


@dataclasses.dataclass(frozen=True)
class AxisValue:
    label: str
    overrides: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Axis:
    name: str
    values: tuple[AxisValue, ...]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the grid: its label per axis and the overrides that make it."""

    labels: tuple[tuple[str, str], ...]  # (axis, value label), in grid order
    overrides: tuple[str, ...]

    @property
    def name(self) -> str:
        # blank labels: another sweep's baseline row says nothing on this sweep's other axes
        return " ".join(f"{axis}={label}" for axis, label in self.labels if label) or "base"

    @property
    def folder(self) -> str:
        """A file-system-safe, readable folder name."""
        text = "_".join(f"{axis}-{label}" for axis, label in self.labels) or "base"
        return re.sub(r"[^A-Za-z0-9._-]+", "-", text)


@dataclasses.dataclass(frozen=True)
class BaselineFrom:
    """Another sweep's cell as this sweep's baseline, paired by seed: one setting's runs
    shared by two sweeps (the study's module-level GRPO cell is its adapter half's one-adapter
    side), run once, by the sweep that owns them."""

    sweep: str  # that sweep's file
    cell: tuple[tuple[str, str], ...]  # its labels there, as `baseline` names a cell
    label: str  # the row's value on this sweep's first axis

    def source(self) -> tuple[SweepConfig, Cell]:
        """That sweep and its cell; an error naming the file when either is not there."""
        return self._source

    @functools.cached_property
    def _source(self) -> tuple[SweepConfig, Cell]:
        # read once per BaselineFrom: every run folder of the row comes from the same reading,
        # even if the file is edited while the sweep runs
        if not Path(self.sweep).is_file():
            raise UserError(f"sweep baseline_from.sweep={self.sweep!r} is not a file")
        raw = read_yaml(self.sweep)
        # read before the file is built: a file naming itself, or two naming each other, would
        # otherwise build each other forever
        if isinstance(raw, Mapping) and raw.get("baseline_from") is not None:
            raise UserError(
                f"sweep baseline_from.sweep={self.sweep!r} takes its own baseline from "
                f"{raw['baseline_from']!r}: name the sweep that runs the cell"
            )
        other = load_sweep(self.sweep)
        for cell in other.cells:
            if dict(cell.labels) == dict(self.cell):
                return other, cell
        raise UserError(
            f"sweep baseline_from.cell {dict(self.cell)} names no cell of {self.sweep!r}; its "
            f"cells: {[c.name for c in other.cells]}"
        )


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    command: str = setting(
        "train", "the mmgrpo subcommand every run is: demo | train | better-together"
    )
    config: str | None = setting(None, "that command's YAML config: every run's base")
    overrides: tuple[str, ...] = setting((), "key=value on every run")
    grid: tuple[Axis, ...] = ()
    seeds: tuple[int, ...] = (0,)
    out: str = setting(
        "runs/sweep", "the sweep folder: runs/<cell>/seed<k>, table.md, table.csv, ..."
    )
    jobs: int = setting(1, "runs at a time")
    single_thread: bool = setting(
        False,
        (
            "Each run's XLA CPU work on one thread (--xla_cpu_multi_thread_eigen=false): "
            "tiny policies gain little from threads, so jobs=cores with this is the fastest"
            " sweep of them on a CPU."
        ),
    )
    baseline: tuple[tuple[str, str], ...] = setting(
        (), "the cell others are compared to; default: first"
    )
    baseline_from: BaselineFrom | None = setting(None, "or another sweep's cell (module doc)")
    prompt_stage_from: tuple[tuple[str, str], ...] = setting(
        (),
        (
            "better-together: {value: source} of the first axis; that cell's p stage is read "
            "from the source cell's finished MIPROv2 run of the same seed (module doc)"
        ),
    )
    start_scores_from: str | None = setting(
        None,
        (
            "better-together: a value of the first axis whose cell runs strategy=none; every "
            "other cell's start stage is read from that cell's finished run of the same seed "
            "(module doc)"
        ),
    )
    score: str = setting("eval_reward_after", "summary.json's key for a run's final score")
    curve: str = setting(
        "eval_reward", "metrics.jsonl's key for learning curves and steps-to-threshold"
    )
    threshold: float | None = None
    diagnostics: tuple[str, ...] = setting(
        (),
        (
            "metrics.jsonl keys to explain the scores with (clip fractions, zero-variance "
            "shares, KL): each run's mean over the rows that log one, per cell in "
            "diagnostics.md / diagnostics.csv"
        ),
    )
    confidence: float = 0.95
    title: str = ""

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.command not in SWEEP_COMMANDS:
            raise UserError(
                f"sweep command must be one of {sorted(SWEEP_COMMANDS)}, got {self.command!r}"
            )
        if self.config is not None and not Path(self.config).is_file():
            raise UserError(f"sweep config={self.config!r} is not a file")
        for override in self.overrides:
            _check_override(override, "sweep overrides")
        if self.jobs < 1:
            raise UserError(f"sweep jobs must be >= 1, got {self.jobs}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise UserError(f"sweep seeds must be distinct and >= 0, got {list(self.seeds)}")
        if not 0 < self.confidence < 1:
            raise UserError(f"sweep confidence must be in (0, 1), got {self.confidence}")
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise UserError(f"sweep threshold must be a finite number, got {self.threshold}")
        names = [axis.name for axis in self.grid]
        if len(set(names)) != len(names):
            raise UserError(f"sweep grid names an axis twice: {names}")
        owned = SWEEP_COMMANDS[self.command].owned
        for axis in self.grid:
            if not axis.values:
                raise UserError(f"sweep grid axis {axis.name!r} has no values")
            labels = [v.label for v in axis.values]
            if len(set(labels)) != len(labels):
                raise UserError(f"sweep grid axis {axis.name!r} repeats a value: {labels}")
            for value in axis.values:
                for override in value.overrides:
                    key = _check_override(override, f"sweep grid axis {axis.name!r}")
                    if key in owned:
                        raise UserError(
                            f"sweep grid axis {axis.name!r} sets {key!r}, which the sweep sets "
                            "on every run itself (seeds go in `seeds`)"
                        )
        folders = [c.folder for c in self.cells]
        clashes = sorted({f for f in folders if folders.count(f) > 1})
        if clashes:
            raise UserError(
                f"sweep grid values {clashes} name the same run folder after cleaning; give "
                "the values labels that differ in letters, digits, '.', '_' or '-'"
            )
        if self.baseline:
            matches = [c for c in self.cells if dict(c.labels) == dict(self.baseline)]
            if len(matches) != 1:
                raise UserError(
                    f"sweep baseline {dict(self.baseline)} names no cell of the grid; cells: "
                    f"{[c.name for c in self.cells]}"
                )
        if self.baseline_from is not None:
            self._check_baseline_from(self.baseline_from)
        if self.prompt_stage_from:
            self._check_prompt_stage_from()
        if self.start_scores_from is not None:
            self._check_start_scores_from()

    def _check_first_axis_values(self, where: str, stage: str, values: Sequence[str]) -> None:
        """`values` name cells of a better-together grid by their first-axis value."""
        if self.command != "better-together":
            raise UserError(f"{where}: only better-together runs have {stage}")
        if not self.grid:
            raise UserError(f"{where} needs a grid: it names values of the first axis")
        first = self.grid[0]
        labels = [v.label for v in first.values]
        for label in values:
            if label not in labels:
                raise UserError(
                    f"{where}: {label!r} is not a value of the first axis {first.name!r} "
                    f"(its values: {labels})"
                )

    def _check_prompt_stage_from(self) -> None:
        where = f"sweep prompt_stage_from {dict(self.prompt_stage_from)}"
        named = [label for pair in self.prompt_stage_from for label in pair]
        self._check_first_axis_values(where, "a prompt stage to load", named)
        targets = [t for t, _ in self.prompt_stage_from]
        for target, source in self.prompt_stage_from:
            if source in targets or source == target:
                raise UserError(
                    f"{where}: {source!r} loads its own prompt stage; name the cell that runs "
                    "the search"
                )

    def _check_start_scores_from(self) -> None:
        where = f"sweep start_scores_from {self.start_scores_from!r}"
        self._check_first_axis_values(where, "a start stage to read", [self.start_scores_from])

    def start_source(self, cell: Cell) -> Cell | None:
        """The cell whose run of the same seed (the program as written) gives `cell` its start
        stage's scores, if any: the same labels, the first axis's `start_scores_from`."""
        if self.start_scores_from is None:
            return None
        (axis, label), *rest = cell.labels or (("", ""),)
        if label == self.start_scores_from:
            return None
        labels = ((axis, self.start_scores_from), *rest)
        return next(c for c in self.cells if c.labels == labels)

    def prompt_source(self, cell: Cell) -> Cell | None:
        """The cell whose MIPROv2 run of the same seed gives `cell` its p stage, if any: the
        same labels, the first axis's replaced by `prompt_stage_from`'s."""
        sources = dict(self.prompt_stage_from)
        (axis, label), *rest = cell.labels or (("", ""),)
        if label not in sources:
            return None
        labels = ((axis, sources[label]), *rest)
        return next(c for c in self.cells if c.labels == labels)

    def _check_baseline_from(self, source: BaselineFrom) -> None:
        if self.baseline:
            raise UserError(
                f"sweep names both baseline {dict(self.baseline)} and baseline_from "
                f"{source.sweep!r}: keep one"
            )
        if not self.grid:
            raise UserError(
                "sweep baseline_from needs a grid: its row is a value of the first axis"
            )
        first = self.grid[0]
        if not source.label or source.label in [v.label for v in first.values]:
            raise UserError(
                f"sweep baseline_from.label={source.label!r} must be a new value of the first "
                f"axis {first.name!r} (its values: {[v.label for v in first.values]})"
            )
        other, _ = source.source()
        if other.command != self.command:
            raise UserError(
                f"sweep baseline_from.sweep={source.sweep!r} runs `mmgrpo {other.command}` and "
                f"this sweep `mmgrpo {self.command}`: their scores are not the same measurement"
            )
        if other.score != self.score:
            raise UserError(
                f"sweep baseline_from.sweep={source.sweep!r} scores its runs by "
                f"{other.score!r} and this sweep by {self.score!r}: the difference would compare "
                "two numbers; give both the same score"
            )

    @property
    def cells(self) -> list[Cell]:
        combos = itertools.product(*(axis.values for axis in self.grid))
        return [
            Cell(
                tuple((axis.name, v.label) for axis, v in zip(self.grid, values, strict=True)),
                tuple(o for v in values for o in v.overrides),
            )
            for values in combos
        ]

    @property
    def baseline_cell(self) -> Cell:
        if self.baseline_from is not None:
            return self.reference_cell
        if not self.baseline:
            return self.cells[0]
        return next(c for c in self.cells if dict(c.labels) == dict(self.baseline))

    @property
    def reference_cell(self) -> Cell:
        """`baseline_from`'s row in this sweep's table: its label on the first axis, blank on
        the others; its overrides are the other sweep's business."""
        if self.baseline_from is None:
            raise ValueError("this sweep takes no cell from another sweep")
        first, *rest = self.grid
        return Cell(((first.name, self.baseline_from.label), *((a.name, "") for a in rest)), ())

    @property
    def report_cells(self) -> list[Cell]:
        """The table's rows: `baseline_from`'s cell first, then the grid's."""
        extra = [] if self.baseline_from is None else [self.reference_cell]
        return [*extra, *self.cells]

    @property
    def baseline_text(self) -> str:
        """The baseline as the report names it, with where another sweep's cell comes from."""
        if self.baseline_from is None:
            return self.baseline_cell.name
        source = self.baseline_from
        cell = " ".join(f"{k}={v}" for k, v in source.cell)
        return f"{self.reference_cell.name}: {cell} of {source.sweep}"

    def run_dir(self, cell: Cell, seed: int) -> Path:
        if self.baseline_from is not None and cell == self.reference_cell:
            other, other_cell = self.baseline_from.source()
            return other.run_dir(other_cell, seed)
        return Path(self.out) / "runs" / cell.folder / f"seed{seed}"

    def run_overrides(self, cell: Cell, seed: int) -> list[str]:
        """Every override of one run, in the order they apply (later wins)."""
        keys = SWEEP_COMMANDS[self.command]
        return [
            *self.overrides,
            *cell.overrides,
            f"{keys.seed}={seed}",
            f"{keys.run_dir}={self.run_dir(cell, seed)}",
            f"{keys.resume}=true",  # a run with no checkpoint yet simply starts
            f"{keys.progress}=false",
        ]

    def identity(self, cell: Cell, seed: int) -> dict[str, Any]:
        """What makes a run the same run: a restarted sweep reuses a run folder only if this
        matches. It holds the run's resolved config (so a changed default, base config file or
        grid value is a new run, not a finished one), without the folder's own path (so the
        sweep folder may move)."""
        overrides = self.run_overrides(cell, seed)
        resolved = dataclasses.asdict(command_config(self.command, self.config, overrides))
        *parents, leaf = SWEEP_COMMANDS[self.command].run_dir.split(".")
        node = resolved
        for part in parents:
            node = node[part]
        node.pop(leaf)
        return {"command": self.command, "config": json.loads(json.dumps(resolved))}


def _check_override(override: str, where: str) -> str:
    key, sep, _ = override.partition("=")
    if not sep or not key.strip():
        raise UserError(f"{where}: {override!r} must look like key=value")
    return key.strip()


def parse_seeds(text: str | int | Sequence[int]) -> tuple[int, ...]:
    """``0-9``, ``0,3,5``, ``0-4,8`` or a list of ints."""
    if isinstance(text, bool):
        raise UserError(f"seeds must be a list or a range like 0-9, got {text!r}")
    if isinstance(text, int):
        return (text,)
    if not isinstance(text, str):
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in text):
            raise UserError(f"seeds must be integers, got {list(text)!r}")
        return tuple(text)
    seeds: list[int] = []
    for part in text.replace(" ", "").split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise UserError(f"seeds {text!r}: {part!r} is not a seed or a range like 0-9")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise UserError(f"seeds {text!r}: the range {part!r} runs backwards")
        seeds.extend(range(first, last + 1))
    return tuple(seeds)


def _scalar_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    raise UserError(f"a grid value must be a scalar, got {value!r}")


def parse_grid(spec: str | Mapping[str, Any]) -> tuple[Axis, ...]:
    """The command line's ``"a=1,2 b=x,y"`` or a sweep file's mapping (see the module doc)."""
    if isinstance(spec, str):
        axes = []
        for part in spec.split():
            name, sep, values = part.partition("=")
            if not sep or not name or not values:
                raise UserError(f"grid {spec!r}: {part!r} must look like key=value1,value2")
            labels = values.split(",")
            axes.append(Axis(name, tuple(AxisValue(v, (f"{name}={v}",)) for v in labels)))
        return tuple(axes)
    if not isinstance(spec, Mapping):
        raise UserError(f"grid must be a mapping of axis -> values, got {spec!r}")
    axes = []
    for name, values in spec.items():
        if isinstance(values, Mapping):  # named bundles
            parsed = []
            for label, bundle in values.items():
                if not isinstance(bundle, Mapping):
                    raise UserError(
                        f"grid axis {name!r} value {label!r} must be a mapping of overrides, "
                        f"got {bundle!r}"
                    )
                overrides = tuple(f"{k}={_scalar_text(v)}" for k, v in bundle.items())
                parsed.append(AxisValue(str(label), overrides))
            axes.append(Axis(str(name), tuple(parsed)))
        elif isinstance(values, list):
            texts = [_scalar_text(v) for v in values]
            axes.append(Axis(str(name), tuple(AxisValue(t, (f"{name}={t}",)) for t in texts)))
        else:
            raise UserError(f"grid axis {name!r} must list its values, got {values!r}")
    return tuple(axes)


def parse_labels(
    spec: str | Mapping[str, Any], field: str = "baseline"
) -> tuple[tuple[str, str], ...]:
    """A baseline cell: ``"grouping=module loss=grpo"`` or a mapping."""
    if isinstance(spec, str):
        pairs = [part.partition("=") for part in spec.split()]
        if any(not sep for _, sep, _ in pairs):
            raise UserError(f"{field} {spec!r} must look like axis=value axis=value")
        return tuple((k, v) for k, _, v in pairs)
    if not isinstance(spec, Mapping):
        raise UserError(f"{field} must be a mapping of axis -> value, got {spec!r}")
    return tuple((str(k), _scalar_text(v)) for k, v in spec.items())


def parse_baseline_from(spec: Any, where: str) -> BaselineFrom:
    """``{sweep: FILE, cell: {axis: value}, label: NAME}``, every key required."""
    keys = {"sweep", "cell", "label"}
    if not isinstance(spec, Mapping) or set(spec) != keys:
        raise UserError(
            f"{where}: baseline_from must be a mapping with exactly the keys {sorted(keys)}, "
            f"got {spec!r}"
        )
    if not isinstance(spec["sweep"], str) or not isinstance(spec["label"], str | int | float):
        raise UserError(
            f"{where}: baseline_from.sweep must be a file name and .label a value, got {spec!r}"
        )
    cell = parse_labels(spec["cell"], "baseline_from.cell")
    return BaselineFrom(spec["sweep"], cell, _scalar_text(spec["label"]))


_FIELDS = {f.name for f in dataclasses.fields(SweepConfig)}


def sweep_config(values: Mapping[str, Any], where: str = "sweep") -> SweepConfig:
    """A SweepConfig from a sweep file's mapping (and command-line values on top)."""
    unknown = sorted(set(values) - _FIELDS)
    if unknown:
        raise UserError(f"{where}: unknown keys {unknown}; valid: {sorted(_FIELDS)}")
    kwargs = dict(values)
    if "grid" in kwargs:
        kwargs["grid"] = parse_grid(kwargs["grid"] or {})
    if "seeds" in kwargs:
        kwargs["seeds"] = parse_seeds(kwargs["seeds"])
    if "baseline" in kwargs:
        kwargs["baseline"] = parse_labels(kwargs["baseline"] or {})
    if kwargs.get("baseline_from") is not None:
        kwargs["baseline_from"] = parse_baseline_from(kwargs["baseline_from"], where)
    if "prompt_stage_from" in kwargs:
        kwargs["prompt_stage_from"] = parse_labels(
            kwargs["prompt_stage_from"] or {}, "prompt_stage_from"
        )
    if "overrides" in kwargs:
        overrides = kwargs["overrides"] or []
        if isinstance(overrides, str) or not isinstance(overrides, list):
            raise UserError(f"{where}: overrides must be a list of key=value, got {overrides!r}")
        kwargs["overrides"] = tuple(str(o) for o in overrides)
    if "diagnostics" in kwargs:
        kwargs["diagnostics"] = parse_keys(kwargs["diagnostics"], f"{where}: diagnostics")
    for key, kind in (("jobs", int), ("threshold", float), ("confidence", float)):
        value = kwargs.get(key)
        allowed = int if kind is int else int | float
        if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
            raise UserError(f"{where}: {key} must be {kind.__name__}, got {value!r}")
        if value is not None:
            kwargs[key] = kind(value)
    if not isinstance(kwargs.get("single_thread", False), bool):
        raise UserError(f"{where}: single_thread must be true or false")
    for key in ("command", "config", "out", "score", "curve", "title"):
        if key in kwargs and kwargs[key] is not None and not isinstance(kwargs[key], str):
            raise UserError(f"{where}: {key} must be a string, got {kwargs[key]!r}")
    return SweepConfig(**kwargs)


def parse_keys(value: Any, where: str) -> tuple[str, ...]:
    """Metric keys as a list, or one string of keys separated by commas (the command line's)."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = [k.strip() for k in value.split(",") if k.strip()]
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise UserError(f"{where} must be a list of metrics.jsonl keys, got {value!r}")
    if len(set(value)) != len(value):
        raise UserError(f"{where} names a key twice: {value}")
    return tuple(value)


def load_sweep(path: str | Path | None, **cli: Any) -> SweepConfig:
    """A sweep file (optional) with the command line's values (not None) on top."""
    values: dict[str, Any] = {}
    if path is not None:
        values = read_yaml(path) or {}
        if not isinstance(values, Mapping):
            raise UserError(f"sweep file {str(path)!r} must be a mapping, got {values!r}")
        values = dict(values)
    given = {k: v for k, v in cli.items() if v is not None}
    if "baseline" in given:  # the command line's baseline replaces the file's, either kind
        values.pop("baseline_from", None)
    if "overrides" in given:  # the command line's overrides go after the file's (later wins)
        given["overrides"] = [*(values.get("overrides") or []), *given["overrides"]]
    values.update(given)
    where = f"sweep file {str(path)!r}" if path else "sweep"
    return sweep_config(values, where)


def describe(config: SweepConfig) -> str:
    """One line naming what every run of the sweep shares."""
    base = f"`mmgrpo {config.command}`" + (f" --config {config.config}" if config.config else "")
    if config.overrides:
        base += " " + " ".join(config.overrides)
    return base + f"; seeds {_seed_text(config.seeds)}"


def _seed_text(seeds: Sequence[int]) -> str:
    ordered = sorted(seeds)
    if ordered == list(range(ordered[0], ordered[-1] + 1)) and len(ordered) > 2:
        return f"{ordered[0]}-{ordered[-1]}"
    return ",".join(map(str, seeds))


def identity_json(identity: Mapping[str, Any]) -> str:
    return json.dumps(identity, indent=2, sort_keys=True)
