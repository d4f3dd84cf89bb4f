"""Checkpoints of an mmGRPO run: what a resume needs, written whole or not at all, verified on read.

A checkpoint holds the donated train state (trainable parameters, optimizer state, dropout key),
the KL reference copy when "full" training keeps one, and JSON metadata: the completed step, the
engine's state (its sampling counter), the program's prompt state, the config, the run's wall
time so far, and the shape, dtype and CRC32 of every saved array. orbax writes into a temporary
folder and renames it when complete; leftovers of a write that was killed are removed when the
run directory is opened again. A non-finite array is never saved. On restore the newest
checkpoint that reads back and matches its checksums wins; a damaged newer one is named in a
warning and moved aside; one of another shape (other settings) is refused, not taken for
damaged. A fresh run refuses a run directory that holds another run's checkpoints (orbax would
skip saving the steps that exist, silently losing the new run's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import shutil
import sys
import threading
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.parallel import is_main_process, local_copy
from mmgrpo_jax.rl.step import TrainState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    state: TrainState
    reference: nnx.State | None
    meta: dict[str, Any]  # step, engine, program, config, wall_seconds, arrays

    @property
    def step(self) -> int:
        return int(self.meta["step"])


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be read back, or reads back different from what was saved."""


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written (a full disk, a read-only folder): the run stops
    with the earlier checkpoints intact, and says what a resume would start from."""


def array_records(trees: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shape, dtype and CRC32 of every array's bytes by its path; refuses a non-finite
    floating array (nothing non-finite is ever saved)."""
    records = {}
    for name, tree in trees.items():
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            key = name + jax.tree_util.keystr(path)
            # np.asarray: np.ascontiguousarray would make 0-d arrays 1-d
            array = np.asarray(jax.device_get(local_copy(leaf)))
            floating = np.issubdtype(array.dtype, np.inexact) or array.dtype.kind == "V"  # bf16
            if floating and not np.all(np.isfinite(array.astype(np.float32))):
                raise ValueError(f"refusing to checkpoint a non-finite array: {key}")
            records[key] = {
                "shape": list(array.shape),
                "dtype": str(array.dtype),
                "crc32": f"{zlib.crc32(np.ascontiguousarray(array).view(np.uint8)):08x}",
            }
    return records


def _items(state: TrainState, reference: nnx.State | None) -> dict[str, Any]:
    """The array items of a checkpoint: the train state, and the KL reference when kept."""
    return {"state": state} if reference is None else {"state": state, "reference": reference}


def _layout(trees: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    """Shape and dtype by path of (abstract) arrays, as `array_records` names them."""
    return {
        name + jax.tree_util.keystr(path): (list(leaf.shape), str(np.dtype(leaf.dtype)))
        for name, tree in trees.items()
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def saved_steps(run_dir: str | Path) -> list[int]:
    """The steps with a complete checkpoint (orbax renames a step's folder to its number only
    once the write is complete; unfinished ones carry a tmp suffix)."""
    directory = Path(run_dir) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def refuse_foreign_checkpoints(run_dir: str | Path, resume: bool) -> None:
    """A fresh run must not write where another run's checkpoints are."""
    existing = saved_steps(run_dir)
    if not resume and existing:
        raise UserError(
            f"run_dir={str(run_dir)!r} already holds a run's checkpoints (steps {existing}): "
            "set resume=true to continue that run, or choose another run_dir (a fresh run "
            "never writes over one)"
        )


class Checkpointer:
    """orbax checkpoints under `<run_dir>/checkpoints`, the two newest kept. Open it only while
    holding the run directory's lock: opening removes unfinished writes."""

    def __init__(self, run_dir: str | Path, *, resume: bool, max_to_keep: int = 2) -> None:
        refuse_foreign_checkpoints(run_dir, resume)
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.resume = resume
        self._failed = False  # a save failed (CheckpointWriteError)
        self._unraisable = sys.unraisablehook
        sys.unraisablehook = self._drop_closed_loop_callbacks
        logging.getLogger("asyncio").addFilter(_drop_abandoned_io)

    def save(
        self,
        step: int,
        state: TrainState,
        reference: nnx.State | None,
        meta: dict[str, Any],
    ) -> None:
        if step in self._manager.all_steps():
            return  # the periodic save of this step already holds exactly this state
        trees = _items(state, reference)
        arrays = array_records(trees)
        items = {name: ocp.args.StandardSave(tree) for name, tree in trees.items()}
        items["meta"] = ocp.args.JsonSave({**meta, "step": step, "arrays": arrays})
        absl = logging.getLogger("absl")
        absl.addFilter(_below_error)  # orbax's threads log each failed write with a traceback
        started_with = set(threading.enumerate())
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
            # written before save returns: the caller holds signals back only around this call
            self._manager.wait_until_finished()
        except Exception as err:
            self._failed = True
            _join_new_threads(started_with)  # orbax's other writes end before the cleanup
            with contextlib.suppress(Exception):  # the same failure again
                self._manager.close()
            # orbax's abandoned writes are finalized now, not at exit (where each prints a
            # traceback as the interpreter shuts down); what is left to report at exit is the
            # failure just reported, so it stays quiet (see close)
            gc.collect()
            warnings.filterwarnings(
                "ignore", r"coroutine 'async_serialize.*' was never awaited", RuntimeWarning
            )
            raise CheckpointWriteError(self._write_failure(step, err)) from None
        finally:
            absl.removeFilter(_below_error)

    def restore(
        self,
        state: TrainState,
        reference: nnx.State | None,
        check_meta: Callable[[dict[str, Any]], None] = lambda meta: None,
    ) -> Restored | None:
        """The newest intact checkpoint shaped like `state` (and `reference`), None without
        any (or without resume); an error if there are checkpoints and none is intact.
        `check_meta` sees each candidate's metadata before any array is read (and refuses a
        resume the checkpoint does not fit). Damaged newer checkpoints are moved aside to
        `<run_dir>/damaged-checkpoints/`, so the resumed run saves those steps afresh."""
        steps = sorted(self._manager.all_steps(), reverse=True) if self.resume else []
        damaged: list[tuple[int, str]] = []
        for step in steps:
            try:
                restored = self._restore_step(step, state, reference, check_meta)
            except DamagedCheckpoint as err:
                damaged.append((step, str(err)))
                logger.warning(
                    "the checkpoint of step %d is damaged (%s); trying an older one", step, err
                )
                continue
            if damaged:
                logger.warning("resuming from the intact checkpoint of step %d instead", step)
                self._set_aside([s for s, _ in damaged])
            logger.info("resumed from step %d in %s", step, self.directory)
            return restored
        if damaged:
            listed = "; ".join(f"step {s}: {why}" for s, why in damaged)
            raise UserError(
                f"no intact checkpoint in {str(self.directory)!r}: {listed}; start a fresh run_dir"
            )
        return None

    def _set_aside(self, steps: list[int]) -> None:
        """Move damaged checkpoints out of the way (process 0; every process found the same
        damage and waits for the move before it reloads)."""
        if is_main_process():
            aside = self.directory.parent / "damaged-checkpoints"
            aside.mkdir(exist_ok=True)
            for step in steps:
                target = aside / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                shutil.move(str(self.directory / str(step)), str(target))
                logger.warning("moved the damaged checkpoint of step %d to %s", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("mmgrpo damaged checkpoints set aside")
        self._manager.reload()

    def _restore_step(
        self,
        step: int,
        state: TrainState,
        reference: nnx.State | None,
        check_meta: Callable[[dict[str, Any]], None],
    ) -> Restored:
        where = self.directory / str(step)
        try:
            meta = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            ).meta
        except Exception as err:
            raise DamagedCheckpoint(f"{where / 'meta'} unreadable: {_first_line(err)}") from err
        if "engine" not in meta:  # written before the engine protocol (no dropout key either)
            raise UserError(
                f"the checkpoint of step {step} in {str(self.directory)!r} was written by an "
                "older mmgrpo-jax (no engine state, no dropout key) and cannot be resumed: "
                "start a fresh run_dir"
            )
        check_meta(meta)
        trees = _items(state, reference)
        saved = meta.get("arrays")
        if saved is None:
            logger.warning("the checkpoint of step %d has no checksums (an older writer)", step)
        else:
            _refuse_other_layout(saved, _layout(trees), where)

        def abstract(tree):
            return ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))

        items = {name: abstract(tree) for name, tree in trees.items()}
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as err:
            raise DamagedCheckpoint(f"{where} unreadable: {_first_line(err)}") from err
        read = {name: restored[name] for name in trees}
        try:
            found = array_records(read)
        except ValueError as err:
            raise DamagedCheckpoint(f"{where}: {err}") from err
        if saved is not None:
            bad = sorted(k for k in saved if saved[k]["crc32"] != found[k]["crc32"])
            if bad:
                raise DamagedCheckpoint(
                    f"{where}: {len(bad)} arrays differ from their saved checksum, the first "
                    f"{bad[0]}"
                )
        kept = read.get("reference")
        return Restored(read["state"], kept, dict(meta))

    def _write_failure(self, step: int, err: Exception) -> str:
        """One line: what failed, the free space, and what a resume starts from. The partial
        write is removed (it holds space the user needs back)."""
        for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)
        text = str(err)
        why = "no space left on device" if "No space left" in text else _first_line(err)
        free = shutil.disk_usage(self.directory).free
        intact = saved_steps(self.directory.parent)
        last = f"step {intact[-1]}" if intact else "none (a resume starts at step 0)"
        return (
            f"the checkpoint of step {step} could not be written to {str(self.directory)!r} "
            f"({why}; {free / 1e6:.1f} MB free there); the last intact checkpoint: {last}; "
            "make room and run again with resume=true"
        )

    def close(self) -> None:
        if not self._failed:  # a failed save closed the manager already
            self._manager.wait_until_finished()
            self._manager.close()
        if sys.unraisablehook == self._drop_closed_loop_callbacks:
            sys.unraisablehook = self._unraisable
        if not self._failed:  # the abandoned writes of a failed save are logged at exit
            logging.getLogger("asyncio").removeFilter(_drop_abandoned_io)

    def _drop_closed_loop_callbacks(self, unraisable: Any) -> None:
        """A failed read leaves orbax's pending reads calling back into its closed event loop:
        dozens of "Event loop is closed" tracebacks that would bury the one warning above."""
        err = unraisable.exc_value
        if isinstance(err, RuntimeError) and str(err) == "Event loop is closed":
            return
        self._unraisable(unraisable)


def _refuse_other_layout(
    saved: dict[str, dict[str, Any]], wanted: dict[str, tuple[list[int], str]], where: Path
) -> None:
    """A checkpoint of another shape is not damaged: it belongs to another setting."""
    problems = [f"missing {k}" for k in sorted(set(wanted) - set(saved))]
    problems += [f"unexpected {k}" for k in sorted(set(saved) - set(wanted))]
    for key in sorted(set(saved) & set(wanted)):
        shape, dtype = wanted[key]
        if (saved[key]["shape"], saved[key]["dtype"]) != (shape, dtype):
            problems.append(
                f"{key} is {saved[key]['dtype']}{saved[key]['shape']}, this run's {dtype}{shape}"
            )
    if problems:
        raise UserError(
            f"the checkpoint in {str(where)!r} does not fit this run's model and optimizer "
            f"({len(problems)} differences, the first: {problems[0]}); resume with the settings "
            "that wrote it, or start a fresh run_dir"
        )


def _drop_abandoned_io(record: logging.LogRecord) -> bool:
    """The other reads of a damaged checkpoint (writes of a failed one) fail too, and asyncio
    logs each one later: the first failure is what the user gets, in one line."""
    message = record.getMessage()
    abandoned = message.startswith("Task exception was never retrieved")
    return not (abandoned and "serialize" in message)


def _join_new_threads(started_with: set[threading.Thread], timeout_s: float = 60.0) -> None:
    """Wait for the non-daemon threads started since `started_with` (what interpreter exit
    would wait for), at most `timeout_s` in all."""
    deadline = time.monotonic() + timeout_s
    for thread in set(threading.enumerate()) - started_with:
        if not thread.daemon and thread is not threading.current_thread():
            # orbax's threads raise their failure again from join
            with contextlib.suppress(Exception):
                thread.join(max(deadline - time.monotonic(), 0.0))


def _below_error(record: logging.LogRecord) -> bool:
    """During a save: orbax's ERROR records are held back (a failure is summed up in one
    CheckpointWriteError line)."""
    return record.levelno < logging.ERROR


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"
