"""A sweep's results: what each run left in its folder, one row per cell, and the files written.

A run's final score is `summary.json[score]`; its curve is every `metrics.jsonl` row carrying the
`curve` key. Per cell: the mean score with its bootstrap interval over seeds (sweep.stats), its
interquartile mean and probability of beating the baseline, how many seeds
reached the threshold and the median step at which they did, the mean wall time, and the paired
difference against the baseline cell on the seeds both finished.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import math
import statistics
import textwrap
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.sweep.spec import Cell, SweepConfig, describe
from mmgrpo_jax.sweep.stats import (
    MIN_SEEDS,
    Interval,
    bootstrap_mean,
    interquartile_mean,
    paired_difference,
    performance_profile,
    probability_of_improvement,
    steps_to_threshold,
)
from mmgrpo_jax.trainer.run_log import read_rows, write_atomic

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunResult:
    cell: Cell
    seed: int
    score: float
    curve: tuple[tuple[float, float], ...]  # (step, value) of the `curve` key
    wall_seconds: float
    # a run read back from the sweep's runs.csv (its folder is gone): no curve, and the step
    # at which it reached the threshold as the sweep recorded it
    recorded: bool = False
    recorded_steps: float | None = None
    # per `diagnostics` key the run logged: its mean over the metrics.jsonl rows carrying it
    diagnostics: tuple[tuple[str, float], ...] = ()

    def steps_to(self, threshold: float) -> float | None:
        if self.recorded:
            return self.recorded_steps
        return steps_to_threshold(self.curve, threshold)


class UnreadableRun(UserError):
    """A finished run whose files cannot be read: that run's failure, not the sweep's."""


def read_run(config: SweepConfig, cell: Cell, seed: int) -> RunResult:
    """A finished run's numbers. An unreadable summary or a non-finite score is that run's
    `UnreadableRun` naming the file; a line of metrics.jsonl cut short is dropped with a warning
    (as a resume does); a score the summary lacks is the sweep's error (its `score` key)."""
    run_dir = config.run_dir(cell, seed)
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
        wall_seconds = float(summary["wall_seconds"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise UnreadableRun(
            f"{path} cannot be read ({type(err).__name__}: {err}): remove the run folder to redo it"
        ) from None
    score = summary.get(config.score, "missing")
    if score == "missing":
        raise UserError(
            f"{path} has no {config.score!r} (the sweep's score); it has {sorted(summary)}"
        )
    if not isinstance(score, int | float) or isinstance(score, bool) or not math.isfinite(score):
        raise UnreadableRun(f"{path}: {config.score} is {score!r}, not a finite number")
    curve = []
    logged: dict[str, list[float]] = {key: [] for key in config.diagnostics}
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        for row in read_rows(metrics):
            if config.curve in row:
                curve.append((float(row["step"]), float(row[config.curve])))
            for key, values in logged.items():
                if isinstance(row.get(key), int | float) and math.isfinite(row[key]):
                    values.append(float(row[key]))
    diagnostics = tuple((k, float(np.mean(v))) for k, v in logged.items() if v)
    return RunResult(cell, seed, float(score), tuple(curve), wall_seconds, diagnostics=diagnostics)


@dataclasses.dataclass(frozen=True)
class CellRow:
    cell: Cell
    runs: int
    score: Interval | None  # None until a run of the cell finished
    difference: Interval | None  # paired, against the baseline; None for the baseline itself
    iqm: Interval | None  # the interquartile mean (rliable's), robust to one collapsed seed
    improvement: float | None  # P(a run of this cell beats a baseline run); None: baseline
    reached: int  # seeds whose curve reached the threshold
    median_steps: float | None  # over all seeds, unreached counting as never; None if < half
    wall_seconds: float | None  # mean per run


def cell_rows(config: SweepConfig, results: Sequence[RunResult]) -> list[CellRow]:
    baseline = config.baseline_cell
    by_cell: dict[Cell, dict[int, RunResult]] = {c: {} for c in config.report_cells}
    for result in results:
        by_cell[result.cell][result.seed] = result
    base_scores = {s: r.score for s, r in by_cell[baseline].items()}
    rows = []
    for cell, runs in by_cell.items():
        scores = {s: r.score for s, r in sorted(runs.items())}
        values = list(scores.values())
        interval = bootstrap_mean(values, confidence=config.confidence) if scores else None
        iqm = interquartile_mean(values, confidence=config.confidence) if scores else None
        shared = sorted(set(scores) & set(base_scores))
        difference, improvement = None, None
        if cell != baseline and shared:
            difference = paired_difference(
                {s: scores[s] for s in shared},
                {s: base_scores[s] for s in shared},
                confidence=config.confidence,
            )
            improvement = probability_of_improvement(values, list(base_scores.values()))
        reached, median = 0, None
        if config.threshold is not None and runs:
            steps = [r.steps_to(config.threshold) for r in runs.values()]
            reached = sum(s is not None for s in steps)
            # a seed that never reached it counts as later than any that did (censored): the
            # median exists only when more than half the seeds reached the threshold
            median = statistics.median(math.inf if s is None else s for s in steps)
            median = None if math.isinf(median) else median
        rows.append(
            CellRow(
                cell,
                len(runs),
                interval,
                difference,
                iqm,
                improvement,
                reached,
                median,
                float(np.mean([r.wall_seconds for r in runs.values()])) if runs else None,
            )
        )
    return rows


def _number(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return f"{value:.{digits}f}"


def _interval_text(interval: Interval | None) -> str:
    return "" if interval is None else str(interval)


def markdown(config: SweepConfig, rows: Sequence[CellRow]) -> str:
    axes = [axis.name for axis in config.grid]
    pct = f"{config.confidence:.0%}"
    reach = f"reached {config.curve} >= {config.threshold}" if config.threshold is not None else ""
    head = [*axes, "runs", f"{config.score} mean [{pct} CI]", f"diff vs baseline [{pct} CI]"]
    head += [f"IQM [{pct} CI]", "P(beats baseline)"]
    if reach:
        head += ["seeds that " + reach, "median steps to it (all seeds)"]
    head.append("wall s / run")
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        labels = dict(row.cell.labels)
        diff = "baseline" if row.cell == config.baseline_cell else _interval_text(row.difference)
        if row.difference is not None and not math.isnan(row.difference.low):
            diff += f" (n={row.difference.n})"  # an interval's str names n only when it has none
        cells = [*(labels[a] for a in axes), f"{row.runs}/{len(config.seeds)}"]
        cells += [_interval_text(row.score), diff, _interval_text(row.iqm)]
        cells.append("" if row.improvement is None else f"{row.improvement:.2f}")
        if reach:
            cells += [f"{row.reached}/{row.runs}", _number(row.median_steps, 0)]
        cells.append(_number(row.wall_seconds, 0))
        lines.append("| " + " | ".join(cells) + " |")
    title = config.title or f"Sweep: {config.score} over {', '.join(axes) or 'the base config'}"
    intro = (
        f"{describe(config)}. Each run's score is `summary.json` `{config.score}`; intervals "
        "are `scipy.stats.bootstrap` over seeds (BCa for means and paired differences, "
        "percentile for the interquartile mean); differences are paired by seed against the "
        f"baseline cell ({config.baseline_text}); IQM and P(beats baseline) are rliable's "
        "statistics (Agarwal et al. 2021). Written by `mmgrpo sweep`.\n"
    )
    notes = []
    if any(0 < row.runs < MIN_SEEDS for row in rows):
        notes.append(
            f"\nUnder {MIN_SEEDS} seeds no interval is given: a bootstrap over so few can only "
            "restate them.\n"
        )
    if any(MIN_SEEDS <= row.runs < 5 for row in rows):
        notes.append(
            "\nIntervals over fewer than 5 seeds are rough: a bootstrap cannot reach beyond the "
            "seeds' own range, so they understate the uncertainty.\n"
        )
    if reach:
        notes.append(
            "\nThe median step counts a seed that never reached the threshold as later than "
            "any that did; it is blank unless more than half the seeds reached it.\n"
        )
    return f"# {title}\n\n{intro}\n" + "\n".join(lines) + "\n" + "".join(notes)


def table_csv(config: SweepConfig, rows: Sequence[CellRow]) -> str:
    axes = [axis.name for axis in config.grid]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(
        [
            *axes,
            "runs",
            "score_mean",
            "score_low",
            "score_high",
            "diff_mean",
            "diff_low",
            "diff_high",
            "diff_seeds",
            "iqm",
            "iqm_low",
            "iqm_high",
            "p_beats_baseline",
            "reached",
            "median_steps_to_threshold",
            "wall_seconds_mean",
        ]
    )
    for row in rows:
        labels = dict(row.cell.labels)
        score = row.score or Interval(math.nan, math.nan, math.nan, 0)
        diff = row.difference or Interval(math.nan, math.nan, math.nan, 0)
        iqm = row.iqm or Interval(math.nan, math.nan, math.nan, 0)
        writer.writerow(
            [
                *(labels[a] for a in axes),
                row.runs,
                _number(score.mean, 6),
                _number(score.low, 6),
                _number(score.high, 6),
                _number(diff.mean, 6),
                _number(diff.low, 6),
                _number(diff.high, 6),
                diff.n,
                _number(iqm.mean, 6),
                _number(iqm.low, 6),
                _number(iqm.high, 6),
                _number(row.improvement, 6),
                row.reached if config.threshold is not None else "",
                _number(row.median_steps, 1),
                _number(row.wall_seconds, 1),
            ]
        )
    return buffer.getvalue()


def runs_csv(config: SweepConfig, results: Sequence[RunResult]) -> str:
    axes = [axis.name for axis in config.grid]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*axes, "seed", "score", "steps_to_threshold", "wall_seconds", "run_dir"])
    for r in sorted(results, key=lambda r: (config.report_cells.index(r.cell), r.seed)):
        steps = None
        if config.threshold is not None:
            steps = r.steps_to(config.threshold)
        labels = dict(r.cell.labels)
        writer.writerow(
            [
                *(labels[a] for a in axes),
                r.seed,
                r.score,
                "" if steps is None else steps,
                round(r.wall_seconds, 1),
                config.run_dir(r.cell, r.seed),
            ]
        )
    return buffer.getvalue()


def diagnostics_tables(config: SweepConfig, results: Sequence[RunResult]) -> tuple[str, str]:
    """diagnostics.md and diagnostics.csv: per cell and key, the mean over seeds of each run's
    mean, with the seeds' range. Runs read back from runs.csv have no metrics and count in
    no cell here; a key no run logged is named, not left out."""
    axes = [axis.name for axis in config.grid]
    keys = config.diagnostics
    per_cell: dict[Cell, dict[str, list[float]]] = {
        c: {k: [] for k in keys} for c in config.report_cells
    }
    for result in results:
        for key, value in result.diagnostics:
            per_cell[result.cell][key].append(value)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*axes, "key", "runs", "mean", "min", "max"])
    head = [*axes, "runs", *(f"`{k}`" for k in keys)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for cell, values in per_cell.items():
        labels = dict(cell.labels)
        runs = sum(not r.recorded for r in results if r.cell == cell)
        cells = [*(labels[a] for a in axes), str(runs)]
        for key in keys:
            seen = values[key]
            low, high = (min(seen), max(seen)) if seen else (None, None)
            mean = float(np.mean(seen)) if seen else None
            writer.writerow(
                [*(labels[a] for a in axes), key, len(seen)]
                + [_number(v, 6) for v in (mean, low, high)]
            )
            text = _number(mean)
            if len(seen) > 1:
                text += f" [{_number(low)}, {_number(high)}]"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    read = any(not r.recorded for r in results)
    missing = [k for k in keys if read and not any(v[k] for v in per_cell.values())]
    title = config.title or f"Sweep over {', '.join(axes) or 'the base config'}"
    text = (
        f"# Diagnostics: {title}\n\n{describe(config)}. Per run, the mean of each key over "
        "the metrics.jsonl rows that log it (its training steps); per cell, the mean over "
        "seeds and [the lowest, the highest] seed. Written by `mmgrpo sweep`.\n\n"
        + "\n".join(lines)
        + "\n"
    )
    if missing:
        logger.warning("%s: no finished run logged the diagnostics %s", config.out, missing)
        text += f"\nNo finished run logged {missing}: check the key's spelling in metrics.jsonl.\n"
    return text, buffer.getvalue()


def recorded_runs(
    config: SweepConfig,
    results: Sequence[RunResult],
    present: Iterable[tuple[Cell, int]] = (),
    seeds: Iterable[int] | None = None,
) -> list[RunResult]:
    """The runs the sweep folder's runs.csv lists as finished that `results` lacks (their run
    folders are gone, e.g. a fresh clone of committed results), as the sweep recorded them:
    score, steps to the threshold and wall time, no curve. `present`: (cell, seed) runs whose
    folders are here but could not be read (reported as failed, so not "gone" as well);
    `seeds`: the seeds wanted, if not the sweep's own (its record may hold more). A row
    that names no cell of the sweep, or whose numbers do not read, is an error naming the file
    and row."""
    path = Path(config.out) / "runs.csv"
    if not path.is_file():
        return []
    axes = [axis.name for axis in config.grid]
    cells = {tuple(dict(c.labels)[a] for a in axes): c for c in config.report_cells}
    found = {(r.cell, r.seed) for r in results} | set(present)
    wanted = set(config.seeds if seeds is None else seeds)
    recorded = []
    with path.open(newline="") as f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            labels = tuple(row.get(a) or "" for a in axes)
            try:
                cell, seed = cells[labels], int(row["seed"])
                steps = row.get("steps_to_threshold") or None
                result = RunResult(
                    cell,
                    seed,
                    float(row["score"]),
                    (),
                    float(row["wall_seconds"]),
                    recorded=True,
                    recorded_steps=None if steps is None else float(steps),
                )
            except (KeyError, TypeError, ValueError) as err:
                raise UserError(
                    f"{path} row {line} ({dict(row)}) is not a run of this sweep "
                    f"({type(err).__name__}: {err})"
                ) from None
            if seed in wanted and (cell, seed) not in found:
                recorded.append(result)
    return recorded


def _wrapped(title: str) -> str:
    """A plot title on lines that fit a 5-inch panel (a sweep's title is often a sentence)."""
    return textwrap.fill(title, 60)


def plot_curves(config: SweepConfig, results: Sequence[RunResult], path: Path) -> None:
    """Per cell the mean curve over its seeds and its bootstrap band, at the steps every seed
    logged; one panel per value of the first axis when there are several axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [None]
    if len(config.grid) > 1:
        panels = [v.label for v in config.grid[0].values]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for cell in config.report_cells:
            # another sweep's baseline (not a value of the first axis) is drawn in every panel
            if panel is not None and cell.labels[0][1] != panel and cell in config.cells:
                continue
            runs = [r for r in results if r.cell == cell and r.curve]
            if not runs:
                continue
            common = sorted(set.intersection(*(set(dict(r.curve)) for r in runs)))
            if not common:
                continue
            values = np.array([[dict(r.curve)[s] for s in common] for r in runs])
            bands = [bootstrap_mean(column, confidence=config.confidence) for column in values.T]
            label = " ".join(lab for _, lab in (cell.labels[1:] if panel else cell.labels) if lab)
            ax.plot(common, [b.mean for b in bands], label=f"{label or cell.name} (n={len(runs)})")
            if len(runs) >= MIN_SEEDS:  # fewer: no interval, no band
                ax.fill_between(common, [b.low for b in bands], [b.high for b in bands], alpha=0.15)
        if config.threshold is not None:
            ax.axhline(config.threshold, color="grey", lw=0.8, ls="--")
        title = f"{config.grid[0].name}={panel}" if panel is not None else config.title
        ax.set_title(_wrapped(title), fontsize="medium")
        ax.set(xlabel="step", ylabel=config.curve)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_profiles(config: SweepConfig, results: Sequence[RunResult], path: Path) -> None:
    """rliable's performance profiles: per cell, the fraction of its runs whose final score is
    above each threshold, with the bootstrap band over runs (none under MIN_SEEDS runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scores = [r.score for r in results]
    low, high = min(scores), max(scores)
    pad = 0.05 * (high - low or 1.0)
    taus = np.linspace(low - pad, high + pad, 101)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for cell in config.report_cells:
        values = [r.score for r in results if r.cell == cell]
        if not values:
            continue
        profile = performance_profile(values, taus, confidence=config.confidence)
        line = ax.step(taus, [p.mean for p in profile], where="post", label=cell.name)
        if len(values) >= MIN_SEEDS:
            ax.fill_between(
                taus,
                [p.low for p in profile],
                [p.high for p in profile],
                step="post",
                alpha=0.12,
                color=line[0].get_color(),
            )
    ax.set(xlabel=f"{config.score} threshold", ylabel="fraction of runs above it")
    ax.set_title(_wrapped(config.title or "performance profiles"), fontsize="medium")
    ax.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _write_plot(plot, config: SweepConfig, results: Sequence[RunResult], path: Path) -> None:
    """`plot` drawn beside `path`, then moved over it: a reader never sees half an image."""
    partial = path.with_name(f"{path.stem}.partial{path.suffix}")
    plot(config, results, partial)
    partial.replace(path)


def write_report(config: SweepConfig, results: Sequence[RunResult]) -> list[CellRow]:
    """table.md, table.csv, runs.csv, curves.png and profiles.png (and with `diagnostics`,
    diagnostics.md and diagnostics.csv) under the sweep folder, each
    replaced atomically so a reader (or a kill) never sees half a file. curves.png is left as
    it is when some runs are only records (their curves are gone)."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = cell_rows(config, results)
    for name, text in (
        ("table.md", markdown(config, rows)),
        ("table.csv", table_csv(config, rows)),
        ("runs.csv", runs_csv(config, results)),
    ):
        write_atomic(out / name, text)
    if config.diagnostics:
        text, table = diagnostics_tables(config, results)
        write_atomic(out / "diagnostics.md", text)
        write_atomic(out / "diagnostics.csv", table)
    if results:  # from the final scores alone: a record in runs.csv is enough
        _write_plot(plot_profiles, config, results, out / "profiles.png")
    if any(r.curve for r in results) and not any(r.recorded for r in results):
        _write_plot(plot_curves, config, results, out / "curves.png")
    return rows
