"""Checkpoints of an mmGRPO run: what a resume needs, where it lives, and who may write there.

A checkpoint holds the donated train state (trainable parameters, optimizer state, dropout key),
the KL reference copy when "full" training keeps one, and JSON metadata: the completed step, the
engine's state (its sampling counter), the program's prompt state and the config. A fresh run
refuses a run directory that holds another run's checkpoints (orbax would skip saving the steps
that exist, silently losing the new run's).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from mmgrpo_jax.rl.step import TrainState

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    state: TrainState
    reference: nnx.State | None
    meta: dict[str, Any]  # step, engine, program, config

    @property
    def step(self) -> int:
        return int(self.meta["step"])


class Checkpointer:
    """orbax checkpoints under `<run_dir>/checkpoints`, the two newest kept."""

    def __init__(self, run_dir: str | Path, *, resume: bool, max_to_keep: int = 2) -> None:
        self.directory = (Path(run_dir) / "checkpoints").absolute()
        if not resume and self.directory.is_dir() and any(self.directory.iterdir()):
            raise ValueError(
                f"MMGRPOConfig.run_dir={str(run_dir)!r} already holds checkpoints of another "
                "run: set resume=true to continue it, or choose another run_dir"
            )
        self.resume = resume
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self,
        step: int,
        state: TrainState,
        reference: nnx.State | None,
        meta: dict[str, Any],
    ) -> None:
        if step in self._manager.all_steps():
            return  # the periodic save of this step already holds exactly this state
        items = {
            "state": ocp.args.StandardSave(state),
            "meta": ocp.args.JsonSave({**meta, "step": step}),
        }
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, state: TrainState, reference: nnx.State | None) -> Restored | None:
        """The newest checkpoint shaped like `state` (and `reference`), or None without one."""
        step = self._manager.latest_step() if self.resume else None
        if step is None:
            return None

        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        if "engine" not in meta.meta:  # written before the engine protocol (no dropout key either)
            raise ValueError(
                f"the checkpoint of step {step} in {str(self.directory)!r} was written by an "
                "older mmgrpo-jax (no engine state, no dropout key) and cannot be resumed: "
                "start a fresh run_dir"
            )

        def abstract(tree):
            return ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))

        items = {"state": abstract(state), "meta": ocp.args.JsonRestore()}
        if reference is not None:
            items["reference"] = abstract(reference)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        logger.info("resumed from step %d in %s", step, self.directory)
        kept = restored.reference if reference is not None else None
        return Restored(restored.state, kept, dict(restored.meta))

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
