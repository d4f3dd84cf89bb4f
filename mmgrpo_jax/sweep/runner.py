"""`run_sweep`: every cell x seed as a normal `mmgrpo` run in its own folder, `jobs` at a time.

Each run is a child process (`python -m mmgrpo_jax.cli <command> ... resume=true`), so a crash
stays in its run and a stopped sweep loses at most the steps since each run's last checkpoint:
started again, the sweep skips runs whose summary.json exists and resumes the others. Runs are
launched in a fixed order and the report is rewritten after every finished run. The sweep
folder is locked (one sweep per folder); children get SIGTERM if the sweep dies, even by
SIGKILL (Linux, `sweep.child`), so they checkpoint and release their run folders instead of
running orphaned. Runs go seed by seed (every cell's seed 0, then every cell's seed 1, ...), so
a sweep stopped early compares its cells on the same seeds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TextIO

from tqdm import tqdm

from mmgrpo_jax.commands import COMMANDS, SWEEP_COMMANDS, command_config
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.prompt_opt.better_together import (
    StartScores,
    can_load_prompt_stage,
    parse_strategy,
)
from mmgrpo_jax.sweep.child import PARENT_ENV
from mmgrpo_jax.sweep.report import (
    CellRow,
    RunResult,
    UnreadableRun,
    read_run,
    recorded_runs,
    write_report,
)
from mmgrpo_jax.sweep.spec import Cell, SweepConfig, identity_json
from mmgrpo_jax.trainer.config import (
    changed_keys,
    computes_the_same,
    describe_changes,
    field_defaults,
    flatten,
)
from mmgrpo_jax.trainer.run_lock import RunLock
from mmgrpo_jax.trainer.run_log import write_atomic

logger = logging.getLogger(__name__)

IDENTITY = "sweep_run.json"  # in each run folder: the command and overrides it was run with
LOG = "sweep.log"  # in each run folder: the child's stdout and stderr, appended per attempt
POLL_S = 0.2
LOCK_WAIT_S = 120.0  # how long to wait for a run folder still held by a stopping child


@dataclasses.dataclass(frozen=True)
class Failure:
    cell: Cell
    seed: int
    exit_code: int | None  # None: the run finished, but its files cannot be read
    log: Path  # the run's log, or the file that cannot be read
    last_line: str

    def describe(self) -> str:
        what = "failed" if self.exit_code is None else f"failed (exit {self.exit_code})"
        return f"{self.cell.name} seed {self.seed} {what}: {self.last_line}; see {self.log}"


@dataclasses.dataclass(frozen=True)
class SweepReport:
    rows: list[CellRow]
    results: list[RunResult]
    failures: list[Failure]
    skipped: int  # runs that had finished before this invocation


@dataclasses.dataclass
class _Child:
    cell: Cell
    seed: int
    process: subprocess.Popen
    log: IO[str]


def check_runs(config: SweepConfig) -> None:
    """Build every run's config in this process before anything starts, so a bad grid value
    is one error naming its cell, not N failed children."""
    for cell in config.cells:
        try:
            command_config(config.command, config.config, config.run_overrides(cell, 0))
        except (ValueError, FileNotFoundError) as err:
            raise UserError(f"sweep cell {cell.name}: {err}") from None
    for cell in config.cells:
        if (source := config.prompt_source(cell)) is not None:
            _check_prompt_source(config, cell, source)
        if (source := config.start_source(cell)) is not None:
            _check_start_source(config, cell, source)


# what may differ between a BetterTogether run and the MIPROv2 run whose prompts it loads
_NOT_READ_BY_THE_SEARCH = {"strategy", "prompt_stage", "mmgrpo.run_dir", "prompt_opt.out_dir"}


def _check_prompt_source(config: SweepConfig, cell: Cell, source: Cell) -> None:
    """The loaded prompts must be the ones this run's own p stage would have searched for:
    a lone p stage, on the same config."""
    where = f"sweep prompt_stage_from: {cell.name} from {source.name}"
    run, searched = (
        command_config(config.command, config.config, config.run_overrides(c, 0))
        for c in (cell, source)
    )
    if parse_strategy(searched.strategy) != ["p"]:
        raise UserError(f"{where}: {source.name} runs strategy={searched.strategy!r}, not 'p'")
    if not can_load_prompt_stage(run.strategy):
        raise UserError(
            f"{where}: {cell.name} runs strategy={run.strategy!r}; a loaded stage stands for "
            "a strategy's one prompt stage, first"
        )
    _refuse_differences(
        where,
        run,
        searched,
        _NOT_READ_BY_THE_SEARCH,
        "the search would not be the same (even a key only the weight stage reads is refused)",
    )


def _refuse_differences(
    where: str, run: object, source: object, allowed: set[str], why: str
) -> None:
    """Two cells' resolved configs must agree on every key but the `allowed` ones."""
    ours, theirs = (flatten(json.loads(json.dumps(dataclasses.asdict(c)))) for c in (run, source))
    differ = sorted(
        k for k in set(ours) | set(theirs) if k not in allowed and ours.get(k) != theirs.get(k)
    )
    if differ:
        raise UserError(
            f"{where}: the two cells differ in {describe_changes(theirs, ours, differ)}; {why}"
        )


# what may differ between a run and the program-as-written run whose start scores it reads:
# keys the start stage (the program as given, scored greedily on dev and test) never reads
_NOT_READ_BY_THE_START = {
    "strategy", "prompt_stage", "start_scores", "mmgrpo.run_dir", "prompt_opt.out_dir",
    "mmgrpo.grouping",
}  # fmt: skip


def _check_start_source(config: SweepConfig, cell: Cell, source: Cell) -> None:
    """The scores read must be the ones this run's start stage would have scored: the program
    as written, on the same config but for what only a later stage reads."""
    where = f"sweep start_scores_from: {cell.name} from {source.name}"
    run, written = (
        command_config(config.command, config.config, config.run_overrides(c, 0))
        for c in (cell, source)
    )
    if parse_strategy(written.strategy):
        raise UserError(f"{where}: {source.name} runs strategy={written.strategy!r}, not 'none'")
    if not parse_strategy(run.strategy):
        raise UserError(f"{where}: {cell.name} runs strategy='none' too; it is the one to read")
    _refuse_differences(
        where,
        run,
        written,
        _NOT_READ_BY_THE_START,
        "the start stage would not be the same program on the same splits",
    )


def _prompt_file(config: SweepConfig, cell: Cell, seed: int) -> Path:
    """Where `cell`'s MIPROv2 run of `seed` saves the prompts it chose."""
    run = command_config(config.command, config.config, config.run_overrides(cell, seed))
    return run.prompts_dir / "prompt_state.json"


def run_sweep(
    config: SweepConfig,
    *,
    out: TextIO | None = None,
    progress: bool = True,
    report_only: bool = False,
) -> SweepReport:
    """Run what is missing, write the report after each run, return it. `report_only`: start
    nothing, write the report of the runs finished so far."""
    check_runs(config)
    sweep_dir = Path(config.out)
    with RunLock(sweep_dir, role="sweep out"):
        write_atomic(sweep_dir / "sweep.json", json.dumps(_describe(config), indent=2) + "\n")
        plan = [(cell, seed) for seed in config.seeds for cell in config.cells]
        results: list[RunResult] = []
        failures: list[Failure] = []
        todo = []
        for cell, seed in plan:
            if _finished(config, cell, seed):
                _collect(config, cell, seed, results, failures)
            else:
                todo.append((cell, seed))
        skipped = len(results)
        _collect_reference(config, results, failures)
        # a finished run that failed to read is reported once, as failed, not also as "gone"
        recorded = recorded_runs(config, results, [(f.cell, f.seed) for f in failures])
        # another sweep's baseline runs are never run here: their record is all there is
        results += [r for r in recorded if r.cell not in config.cells]
        recorded = [r for r in recorded if r.cell in config.cells]
        results.sort(key=lambda r: _order(config, r))
        if recorded:
            logger.warning(
                "%s/runs.csv %s %d finished run(s) whose folders are not here (the first: %s): %s",
                config.out,
                "records" if report_only else "lists",
                len(recorded),
                config.run_dir(recorded[0].cell, recorded[0].seed),
                "the table is reported from that record; curves.png stays as it is"
                if report_only
                else "they are run again, and the table is rewritten as they finish",
            )
        if report_only:  # the table is re-reported from the sweep's own record
            results += recorded
        # never replace a table with one of fewer runs
        rows = [] if recorded and not report_only else write_report(config, results)
        if not report_only:
            failures += _run_all(config, todo, results, plan, progress)
            rows = write_report(config, results)
    if out is not None:
        print((sweep_dir / "table.md").read_text(), file=out)
    return SweepReport(rows, results, failures, skipped)


def _collect(
    config: SweepConfig,
    cell: Cell,
    seed: int,
    results: list[RunResult],
    failures: list[Failure],
) -> bool:
    """A finished run's result into `results`, or, if its files cannot be read, its failure
    into `failures` (the other runs go on)."""
    try:
        results.append(read_run(config, cell, seed))
        return True
    except UnreadableRun as err:
        summary = config.run_dir(cell, seed) / "summary.json"
        failures.append(Failure(cell, seed, None, summary, str(err)))
        logger.warning("run %s", failures[-1].describe())
        return False


def _collect_reference(
    config: SweepConfig, results: list[RunResult], failures: list[Failure]
) -> None:
    """`baseline_from`'s finished runs on this sweep's seeds, read from the sweep that owns
    them (which checks they are its cell's setting); the missing ones are named, not run, and
    a problem with one is reported as that sweep's to mend."""
    if config.baseline_from is None:
        return
    source = config.baseline_from
    other, other_cell = source.source()
    owner = f"baseline_from {source.sweep} {other_cell.name}"
    redo = f"(the run is that sweep's: `mmgrpo sweep --sweep {source.sweep}` redoes it)"
    # where a run's folder is gone (a clone of the committed tables), the owner's own record
    owner_record = {
        r.seed: r for r in recorded_runs(other, [], seeds=config.seeds) if r.cell == other_cell
    }
    missing = []
    for seed in config.seeds:
        try:
            finished = _finished(other, other_cell, seed)
        except UserError as err:  # a run folder of another setting
            raise UserError(f"{owner}: {err}") from None
        if not finished:
            if seed in owner_record:
                results.append(dataclasses.replace(owner_record[seed], cell=config.reference_cell))
            else:
                missing.append(seed)
            continue
        try:
            results.append(read_run(config, config.reference_cell, seed))
        except UnreadableRun as err:
            summary = other.run_dir(other_cell, seed) / "summary.json"
            failure = Failure(config.reference_cell, seed, None, summary, f"{owner}: {err} {redo}")
            failures.append(failure)
            logger.warning("run %s", failure.describe())
    if missing:
        logger.warning(
            "%s has not finished seeds %s: the sweep that owns the cell runs them (`mmgrpo "
            "sweep --sweep %s`, with --seeds if its file does not list them); until then those "
            "seeds have no paired difference",
            owner,
            missing,
            source.sweep,
        )


def _order(config: SweepConfig, result: RunResult) -> tuple[int, int]:
    """The plan's order, seed by seed, another sweep's baseline first in each seed."""
    return config.seeds.index(result.seed), config.report_cells.index(result.cell)


def _describe(config: SweepConfig) -> dict:
    return {
        "command": config.command,
        "config": config.config,
        "overrides": list(config.overrides),
        "cells": [c.name for c in config.cells],
        "seeds": list(config.seeds),
        "score": config.score,
        "curve": config.curve,
        "threshold": config.threshold,
        "baseline": config.baseline_text,
    }


def _finished(config: SweepConfig, cell: Cell, seed: int) -> bool:
    summary = config.run_dir(cell, seed) / "summary.json"
    _check_identity(config, cell, seed)
    key = SWEEP_COMMANDS[config.command].finished_key
    if key is None or not summary.is_file():
        return summary.is_file()
    try:
        return key in json.loads(summary.read_text())
    except (OSError, ValueError):
        return True  # finished as far as the sweep can tell: read_run names the broken file


def _check_identity(config: SweepConfig, cell: Cell, seed: int) -> None:
    """A run folder is reused only by the run that made it."""
    path = config.run_dir(cell, seed) / IDENTITY
    if not path.is_file():
        return
    expected = _settings(config.identity(cell, seed))  # already JSON-shaped
    try:
        found = _settings(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError, AttributeError):
        found = {"(unreadable)": path.read_text()[:80]}
    changed = changed_keys(found, expected, _defaults(config.command))
    # a new memory default (packing, shared prefixes) leaves a finished run the same run
    changed = [k for k in changed if not computes_the_same(k, found, expected)]
    if changed:
        details = describe_changes(found, expected, changed)
        raise UserError(
            f"{path.parent} holds a run of another setting ({details}): give this sweep "
            "another out folder, or remove that run folder"
        )


def _defaults(command: str) -> dict:
    """The command config's field defaults as settings: a field added since a run folder was
    made, at its default, does not make that run another setting."""
    return {"command": command, **field_defaults(COMMANDS[command].config_class())}


def _settings(identity: dict) -> dict:
    """An identity as flat `key: value` settings, for a diff a user can read."""
    return {"command": identity.get("command"), **flatten(identity.get("config", identity))}


def _run_all(
    config: SweepConfig,
    todo: list[tuple[Cell, int]],
    results: list[RunResult],
    plan: Sequence[tuple[Cell, int]],
    progress: bool,
) -> list[Failure]:
    failures: list[Failure] = []
    running: list[_Child] = []
    shown: dict[str, int] = {}
    bar = tqdm(
        total=len(plan),
        initial=len(plan) - len(todo),
        desc="sweep",
        unit="run",
        disable=not progress,
    )
    try:
        while todo or running:
            while len(running) < config.jobs and (ready := _ready(config, todo, running)):
                todo.remove(ready)
                running.append(_launch(config, *ready))
            time.sleep(POLL_S)
            for child in [c for c in running if c.process.poll() is not None]:
                running.remove(child)
                child.log.close()
                code = child.process.returncode
                if code == 0:
                    if _collect(config, child.cell, child.seed, results, failures):
                        results.sort(key=lambda r: _order(config, r))
                        write_report(config, results)
                    bar.update()
                    continue
                failure = _failure(config, child, code)
                failures.append(failure)
                logger.warning("run %s", failure.describe())
            status = {"running": len(running), "failed": len(failures)}
            if status != shown:
                bar.set_postfix(status)
                shown = status
    except KeyboardInterrupt as err:
        done = sum(r.cell in config.cells for r in results)  # not another sweep's baseline
        err.add_note(
            f"{done}/{len(plan)} runs finished; running ones were stopped at their last "
            f"checkpoint; the same sweep again continues them ({config.out})"
        )
        raise
    finally:
        _stop(running)  # on any way out: no run outlives its sweep
        bar.close()
    return failures


def _ready(
    config: SweepConfig, todo: list[tuple[Cell, int]], running: list[_Child]
) -> tuple[Cell, int] | None:
    """The first run to launch: in the plan's order, but a run that reads another's prompts or
    start scores waits while that run is still to run or running."""
    pending = {*todo, *((c.cell, c.seed) for c in running)}
    for cell, seed in todo:
        sources = (config.prompt_source(cell), config.start_source(cell))
        if not any((source, seed) in pending for source in sources if source is not None):
            return cell, seed
    return None


def _prompt_stage_overrides(config: SweepConfig, cell: Cell, seed: int) -> list[str]:
    """`prompt_stage=` for a run whose p stage is another run's search, once that run has
    saved its prompts; otherwise the run searches itself, and the log says why."""
    source = config.prompt_source(cell)
    if source is None:
        return []
    path = _prompt_file(config, source, seed)
    if path.is_file():
        return [f"prompt_stage={path}"]
    logger.warning(
        "%s seed %d searches its own prompt stage: %s seed %d left no %s (it failed, or its "
        "record was committed without its prompts)",
        cell.name,
        seed,
        source.name,
        seed,
        path,
    )
    return []


def _start_scores_overrides(config: SweepConfig, cell: Cell, seed: int) -> list[str]:
    """`start_scores=` for a run whose start stage another run scored, once that run has
    finished; otherwise the run scores its start itself, and the log says why."""
    source = config.start_source(cell)
    if source is None:
        return []
    summary = config.run_dir(source, seed) / "summary.json"
    try:
        StartScores.read(summary)
        return [f"start_scores={summary}"]
    except ValueError as err:
        logger.warning(
            "%s seed %d scores its own start stage: %s seed %d left no readable scores (%s)",
            cell.name,
            seed,
            source.name,
            seed,
            err,
        )
        return []


def _launch(config: SweepConfig, cell: Cell, seed: int) -> _Child:
    run_dir = config.run_dir(cell, seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    _wait_for_release(run_dir)
    _check_identity(config, cell, seed)  # also here: two cells must never share a folder
    identity = run_dir / IDENTITY
    if not identity.is_file():
        write_atomic(identity, identity_json(config.identity(cell, seed)) + "\n")
    # not in the identity: a loaded stage (or start) is the same run as a scored one
    command = [
        *command_line(config, cell, seed),
        *_prompt_stage_overrides(config, cell, seed),
        *_start_scores_overrides(config, cell, seed),
    ]
    log = (run_dir / LOG).open("a")
    log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(
        command,
        env=child_environment(config),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # its own process group: a terminal's Ctrl-C reaches the sweep only, which stops each
        # run with one SIGTERM (a second signal would make a run skip its checkpoint)
        start_new_session=True,
    )
    return _Child(cell, seed, process, log)


def command_line(config: SweepConfig, cell: Cell, seed: int) -> list[str]:
    """The child process of one run: the `mmgrpo` command a user would type."""
    command = [sys.executable, "-m", "mmgrpo_jax.cli", config.command]
    if config.config:
        command += ["--config", config.config]
    return command + config.run_overrides(cell, seed)


def child_environment(config: SweepConfig) -> dict[str, str]:
    """This process's environment, naming this process as the parent the run must die with,
    and with XLA's CPU work on one thread if the sweep says so."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}  # the child dies with us (sweep.child)
    if config.single_thread:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false".strip()
    return env


def _wait_for_release(run_dir: Path) -> None:
    """A child of a killed sweep may still be writing its checkpoint: wait for its lock."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            with RunLock(run_dir):
                return
        except UserError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _stop(running: list[_Child]) -> None:
    """SIGTERM every child (each saves its last completed step) and wait for them."""
    for child in running:
        if child.process.poll() is None:
            child.process.send_signal(signal.SIGTERM)
    for child in running:
        child.process.wait()
        child.log.close()
    running.clear()


def _failure(config: SweepConfig, child: _Child, code: int) -> Failure:
    log = config.run_dir(child.cell, child.seed) / LOG
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return Failure(child.cell, child.seed, code, log, lines[-1] if lines else "(no output)")
