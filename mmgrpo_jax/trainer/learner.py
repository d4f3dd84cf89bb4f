"""The learner's state between steps (the jitted functions and the train state they pass
along) and the guard that stops a run which cannot be learning."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from mmgrpo_jax import parallel
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.rl.step import FrozenWeights, TrainState, TrainStep
from mmgrpo_jax.rl.types import Trajectory
from mmgrpo_jax.trainer.config import MMGRPOConfig
from models.decoder import Decoder

logger = logging.getLogger(__name__)


def give_back(model: Decoder, state: TrainState) -> None:
    """The trained weights into the model, unless a failed update left them donated."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(state.trainable)):
        logger.error(
            "the model keeps its weights from before the run: the update that failed "
            "had consumed the train state"
        )
        return
    nnx.update(model, parallel.local_copy(state.trainable))


class Guard:
    """Stops a run that cannot be learning: updates that keep coming out non-finite, or a
    metric / program that raises on (nearly) every rollout step after step."""

    def __init__(self, config: MMGRPOConfig) -> None:
        self.config = config
        self.skipped_in_a_row = 0
        self.failed_steps_in_a_row = 0

    def count_update(self, applied: bool, metrics: dict[str, float], step: int) -> None:
        if applied:
            self.skipped_in_a_row = 0
            return
        self.skipped_in_a_row += 1
        limit = self.config.max_skipped_updates
        logger.warning(
            "step %d: update skipped, loss=%s grad_norm=%s (%d in a row, the run stops at %d)",
            step + 1,
            metrics.get("loss"),
            metrics.get("grad_norm"),
            self.skipped_in_a_row,
            limit,
        )
        if self.skipped_in_a_row >= limit:
            raise UserError(
                f"step {step + 1}: {limit} updates in a row had a non-finite loss, gradient norm "
                f"or result (loss={metrics.get('loss')}, grad_norm={metrics.get('grad_norm')}) "
                "and were skipped; no checkpoint holds them. Start again in a fresh run_dir with "
                f"a lower optim.lr (now {self.config.optim.lr}) or optim.max_grad_norm (now "
                f"{self.config.optim.max_grad_norm})"
            )

    def check_rollouts(self, trajectories: Sequence[Trajectory], step: int) -> None:
        errors = [t for t in trajectories if t.status == "error"]
        fraction = len(errors) / max(len(trajectories), 1)
        if not errors or fraction < self.config.failing_error_fraction:
            self.failed_steps_in_a_row = 0
            return
        self.failed_steps_in_a_row += 1
        if self.failed_steps_in_a_row >= self.config.max_failed_steps:
            raise UserError(
                f"step {step + 1}: {len(errors)} of {len(trajectories)} rollouts raised, "
                f"{self.failed_steps_in_a_row} steps in a row (max_failed_steps="
                f"{self.config.max_failed_steps}); the first: {errors[0].error}"
            )


@dataclasses.dataclass
class Learner:
    """The jitted functions of a run and the state they pass along."""

    state: TrainState
    frozen: FrozenWeights
    step_fn: TrainStep
    logprob_fn: Callable
    idle_fn: Callable[[TrainState], TrainState]

    def compiles(self) -> int:
        """Programs compiled so far by the learner's jitted functions (all shapes)."""
        return sum(fn._cache_size() for fn in (self.step_fn, self.logprob_fn, self.idle_fn))
