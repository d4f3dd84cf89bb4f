"""One training run's lifecycle around the loop: stop signals, the run lock, checkpoints
(written when due, on a stop and at the end; read back on resume, refused when the settings
changed), the log and the engine. `MMGRPO.compile` is the algorithm; `Run` is what makes it safe
to interrupt and continue."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from mmgrpo_jax import parallel
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.rl.types import Trajectory
from mmgrpo_jax.trainer.checkpoint import Checkpointer, Restored, refuse_foreign_checkpoints
from mmgrpo_jax.trainer.config import (
    DistributedConfig,
    MemoryConfig,
    MMGRPOConfig,
    ParallelConfig,
    changed_keys,
    describe_changes,
    field_defaults,
    flatten,
)
from mmgrpo_jax.trainer.interrupt import Interrupted, StopSignals
from mmgrpo_jax.trainer.learner import Guard, give_back
from mmgrpo_jax.trainer.run_lock import RunLock
from mmgrpo_jax.trainer.run_log import RunLogError, RunLogger, read_json
from models.export import save_peft_adapter

if TYPE_CHECKING:  # the trainer builds its run; the run calls back into it
    from mmgrpo_jax.trainer.mmgrpo import MMGRPO

logger = logging.getLogger(__name__)


def check_run_dir(config: MMGRPOConfig) -> None:
    """What `compile` would refuse about config.run_dir (another run holds it; a fresh run
    into another run's checkpoints), checked before a model is loaded (by process 0: the
    others share its run_dir)."""
    if not parallel.is_main_process():
        return
    with RunLock(config.run_dir):
        refuse_foreign_checkpoints(config.run_dir, config.resume)


# What a resume may change (dotted keys): how long the run goes on, where it and its base model
# live, what it logs, when it gives up, how long the sampler waits for a full batch.
RESUMABLE_FIELDS = frozenset(
    {
        "num_steps",
        "resume",
        "run_dir",
        "model_path",
        "progress",
        "eval_every",
        "samples_per_step",
        "checkpoint_every",
        "max_skipped_updates",
        "failing_error_fraction",
        "max_failed_steps",
        # how requests are scheduled, not what they sample (keys are per request)
        "sampler.max_wait_s",
        "sampler.engine",
        "sampler.decode_steps",
        "sampler.prefix_sharing",
        # how much is recomputed, not what: a run that ran out of memory resumes with more remat
        *(f"memory.{f.name}" for f in dataclasses.fields(MemoryConfig)),
        # where it runs: samples are keyed per request, so neither the mesh nor the number of
        # processes changes them (beyond floating-point differences of other batch shapes)
        *(f"parallel.{f.name}" for f in dataclasses.fields(ParallelConfig)),
        *(f"distributed.{f.name}" for f in dataclasses.fields(DistributedConfig)),
    }
)


class Run:
    """One `compile`'s lifecycle: stop signals, the run lock, checkpoints (written when due, on
    a stop and at the end; read back on resume), the log, the engine and its two LMs, the
    learner and the last completed step. `MMGRPO.compile` is the algorithm; this is what makes
    it safe to interrupt and continue."""

    def __init__(self, trainer: MMGRPO, program: Module, closing: ExitStack) -> None:
        cfg = self.config = trainer.config
        self.trainer, self.program, self.run_dir = trainer, program, trainer.run_dir
        self.stop = closing.enter_context(StopSignals())
        if parallel.is_main_process():  # before the checkpoints: one writer
            closing.enter_context(RunLock(self.run_dir))
        self.checkpoints = Checkpointer(self.run_dir, resume=cfg.resume)
        closing.callback(self.checkpoints.close)
        self.learner = trainer._learner()
        # the model gets the trained weights however the run ends (the engine has its own)
        closing.callback(lambda: give_back(trainer.model, self.learner.state))
        self.engine = trainer._open_engine(closing)
        self.lm, self.greedy = trainer._lms(self.engine)
        restored = self._resume()
        self.done = 0 if restored is None else restored.step  # the last completed step
        self.finished = restored is not None and parallel.process_zero_says(self._finished())
        if self.finished:
            return
        trainer.log = self.log = RunLogger(
            self.run_dir,
            resumed_step=None if restored is None else self.done,
            elapsed=0.0 if restored is None else restored.meta.get("wall_seconds", 0.0),
            unwritten=() if restored is None else restored.meta.get("log_unwritten", ()),
            writes=parallel.is_main_process(),
        )
        # a checkpoint holds the state after the last *completed* step, the engine's included
        # (an interrupted step has already drawn from its sampling counter)
        self.engine_state = self.engine.state_dict()
        self.guard = Guard(cfg)
        # several processes: a signal is held and acted on at the next step boundary by every
        # process at once
        if trainer._local_engine:
            self.stop.hold()

    # -- the loop's edges ------------------------------------------------------------------------
    def steps(self) -> Iterator[int]:
        """The steps left; with several processes, a held signal stops them all here."""
        for step in self.trainer._progress(self.done):
            if self.trainer._local_engine and (signum := parallel.any_signal(self.stop.pending)):
                self.stop.stop_now(signum)
            # a signal before the update raises at once: rollouts and evaluation change no state
            yield step

    def check_rollouts(self, trajectories: Sequence[Trajectory], step: int) -> None:
        """The guard's verdict on the step's rollouts; a stop saves the last completed step."""
        try:
            self.guard.check_rollouts(trajectories, step)
        except UserError as err:  # the state is still the last completed step's
            self.save_noted(err)
            raise

    @contextlib.contextmanager
    def completing(self, step: int) -> Iterator[Callable[[dict[str, float], list], None]]:
        """The update and what follows it, as one: a signal waits for the block (the update
        donates the train state); the step's log row and samples passed to the yielded function
        make the step done, logged, and checkpointed when due."""
        records: list[tuple[dict[str, float], list]] = []
        with self.stop.deferred():
            yield lambda record, samples: records.append((record, samples))
            ((record, samples),) = records
            self.done, self.engine_state = step + 1, self.engine.state_dict()
            self.log.log(record)
            self.log.log_samples(samples)
            if self.done % self.config.checkpoint_every == 0:
                self._checkpoint()

    @contextlib.contextmanager
    def saving_on_stop(self) -> Iterator[None]:
        """Ctrl-C, SIGTERM or a failed log write: the last completed step's checkpoint first."""
        try:
            yield
        except RunLogError as err:  # the log of a completed step: save that step
            self.save_noted(err)
            raise
        except KeyboardInterrupt as err:
            why = err.signal_name if isinstance(err, Interrupted) else "KeyboardInterrupt"
            logger.warning("%s: writing the checkpoint of step %d before exiting", why, self.done)
            self.save_noted(err)
            raise

    def finish(self) -> dict[str, Any]:
        """The last checkpoint, the weights into the model, the adapter, summary.json."""
        cfg = self.config
        # the run is complete: a signal from here on waits for the last writes and teardown
        self.stop.hold()
        self.save()
        give_back(self.trainer.model, self.learner.state)
        if cfg.train == "lora" and parallel.is_main_process():
            base = cfg.model_path or ""  # PEFT's base_model_name_or_path: what loading checks
            save_peft_adapter(self.trainer.model, self.run_dir / "adapter", base_model=base)
        # steps whose gradient was zero ran no forward or backward pass (make_idle_step)
        idle = int(sum(r.get("idle_update", 0.0) for r in self.log.history))
        steps = [r for r in self.log.history if "status_ok" in r]
        if steps and not sum(r["status_ok"] for r in steps):  # the reason, not "idle"
            unparsed = int(sum(r["status_format_failure"] for r in steps))
            raised = int(sum(r["status_error"] for r in steps))
            remedies = [
                "a reply format the policy can write (bare=True predictors, or BareAdapter for "
                "a DSPy program) or a stronger policy"
                if unparsed
                else "",
                "the errors mended (the warnings above name each, the program's or the metric's)"
                if raised
                else "",
            ]
            logger.warning(
                "no rollout of this run succeeded: of %d trajectories, %d failed to parse a "
                "reply (format failures) and %d raised an error, so every reward was a failure "
                "score and nothing was learnt; needed: %s",
                sum(r["trajectories"] for r in steps),
                unparsed,
                raised,
                "; ".join(r for r in remedies if r),
            )
        elif idle and idle == cfg.num_steps and cfg.loss.beta == 0:
            logger.warning(
                "all %d steps of this run were idle: in every group the rewards were equal "
                "(no advantage), so nothing was learnt; a policy that already gets some "
                "rewards right, more rollouts (num_rollouts) or a graded metric give the "
                "groups a spread",
                idle,
            )
        return self.log.close(
            {"steps": cfg.num_steps, "grouping": cfg.grouping, "idle_updates": idle}
        )

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self) -> None:
        with self.stop.deferred():
            self._checkpoint()

    def save_noted(self, err: BaseException) -> None:
        self.save()
        err.add_note(
            f"the checkpoint of step {self.done} is in {str(self.run_dir)!r}; resume=true "
            "continues the run"
        )

    def _checkpoint(self) -> None:
        meta = {
            "engine": self.engine_state,
            "program": self.program.dump_state(),
            "config": dataclasses.asdict(self.config),
            "wall_seconds": self.log.elapsed,
            "log_unwritten": self.log.unwritten,  # rows a resume writes (RunLogError)
        }
        self.checkpoints.save(self.done, self.learner.state, self.learner.frozen.reference, meta)

    def _finished(self) -> bool:
        """Whether run_dir holds this run, finished at the restored step (its summary written
        then)."""
        done = self.done
        path = self.run_dir / "summary.json"
        if done < self.config.num_steps or not path.is_file():
            return False
        summary = read_json(path, "remove it: the run is finished again from its checkpoint")
        # better-together keeps its weight stage's summary inside its own
        steps = summary.get("steps", (summary.get("weight_stage") or {}).get("steps"))
        if steps != done:  # the summary of an earlier, shorter finish
            return False
        logger.warning(
            "%s holds a finished run (step %d of %d): nothing to do; raise num_steps to train on",
            self.run_dir,
            done,
            self.config.num_steps,
        )
        self.trainer.summary = summary
        return True

    def _resume(self) -> Restored | None:
        learner = self.learner
        restored = self.checkpoints.restore(
            learner.state, learner.frozen.reference, check_meta=self._check_resumable
        )
        if restored is None:
            return None
        learner.state = restored.state
        learner.frozen = dataclasses.replace(learner.frozen, reference=restored.reference)
        self.program.load_state(restored.meta["program"])
        self.engine.load_state_dict(restored.meta["engine"])
        self.engine.update_weights(parallel.local_copy(learner.state.trainable))
        return restored

    def _check_resumable(self, meta: dict[str, Any]) -> None:
        """A resume continues the same run: only run-length, logging, stopping and timing
        fields may differ from the checkpoint's config."""
        saved = flatten(meta["config"])
        now = flatten(json.loads(json.dumps(dataclasses.asdict(self.config))))
        changed = changed_keys(saved, now, field_defaults(MMGRPOConfig))
        refused = [k for k in changed if k not in RESUMABLE_FIELDS]
        if refused:
            listed = describe_changes(saved, now, refused)
            raise UserError(
                f"resume=true with a config that differs from the checkpoint's (step "
                f"{meta['step']} in {str(self.run_dir)!r}): {listed}; resume with the "
                "checkpoint's values, or start a fresh run_dir"
            )
        if "num_steps" in changed:
            logger.warning(
                "num_steps %s -> %s: the learning-rate schedule of the remaining steps follows %s",
                saved["num_steps"],
                now["num_steps"],
                now["num_steps"],
            )
        if "model_path" in changed:
            logger.warning(
                "model_path %s -> %s: resuming on the base weights found there (their shapes "
                "are checked, not their values)",
                saved["model_path"],
                now["model_path"],
            )
