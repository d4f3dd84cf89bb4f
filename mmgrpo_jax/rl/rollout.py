"""Rollouts: run each example G times, concurrently, and score every trajectory.

docs/design.md#grouping: a parse failure gets `format_failure_score`, a program or metric exception
gets `failure_score`; neither stops the run, both keep the calls made so far, and both are
counted in `summarize` and logged. Nothing is dropped: every (example, rollout) pair comes back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import numbers
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, TypedDict, Unpack

import numpy as np
from tqdm.auto import tqdm

from mmgrpo_jax.program.adapter import ParseError
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM, BatchingLM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.program.trace import CallRecord, record_trace
from mmgrpo_jax.rl.types import Metric, Status, Trajectory

logger = logging.getLogger(__name__)


# |reward| bound: a group's (or a batch's) sum of squared deviations must stay finite in float32
MAX_ABS_REWARD = 1e15


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _as_reward(value: Any) -> float:
    """Any real scalar: Python, numpy or a 0-d (JAX) array, bools included."""
    if not isinstance(value, bool | numbers.Real):
        array = np.asarray(value) if hasattr(value, "__array__") else None
        if (
            array is None
            or array.ndim != 0
            or not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_)
            or np.issubdtype(array.dtype, np.complexfloating)
        ):
            raise TypeError(f"metric returned {value!r}; expected a real number or a bool")
        value = array.item()
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"metric returned a non-finite reward {reward!r}")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(
            f"metric returned {reward!r}, beyond +-{MAX_ABS_REWARD:g}: advantages are computed in "
            "float32, where the squares of such rewards overflow; rescale the metric"
        )
    return reward


def run_trajectory(
    program: Module,
    example: Example,
    metric: Metric,
    *,
    example_index: int = 0,
    rollout_index: int = 0,
    lm: LM | None = None,
    failure_score: float = 0.0,
    format_failure_score: float = -1.0,
    key_prefix: tuple[int, ...] | None = None,
    replay: Sequence[CallRecord] = (),
) -> Trajectory:
    """Run and score one trajectory; every failure becomes a status, never an exception.

    With `key_prefix` (the training step), every call's sampling key derives from
    (*key_prefix, example_index, rollout_index, call index) (see `Request.key_path`). Calls
    matching a `replay` record are answered from it (see `record_trace`).
    """

    def ended(status: Status, reward: float, error: str | None = None, prediction: Any = None):
        return Trajectory(
            example_index, rollout_index, trace.calls, reward, status, error, prediction
        )

    key = (example_index, rollout_index)
    key_path = None if key_prefix is None else (*key_prefix, *key)
    with record_trace(program, lm=lm, key=key, key_path=key_path, replay=replay) as trace:
        try:
            prediction = program(**example.inputs())
        except ParseError as err:
            return ended("format_failure", format_failure_score, _describe(err))
        except Exception as err:
            return ended("error", failure_score, f"program raised {_describe(err)}")
    # a parse failure the program caught itself still marks the trajectory (docs/design.md#grouping)
    failed = [c for c in trace.calls if not c.parsed]
    if failed:
        first = failed[0]
        error = f"{first.predictor}[{first.invocation}] failed to parse: {first.parse_error}"
        return ended("format_failure", format_failure_score, error, prediction)
    try:
        reward = _as_reward(metric(example, prediction))
    except Exception as err:
        return ended("error", failure_score, f"metric raised {_describe(err)}", prediction)
    return ended("ok", reward, None, prediction)


class RolloutOptions(TypedDict, total=False):
    """How rollouts run and are scored: `run_rollouts`, `run_pairs` and `run_jobs` take these
    by name (the defaults are `run_jobs`')."""

    lm: LM | None  # the LM of every call; None: each predictor's own or the context's
    max_workers: int | None  # threads; None: one per job, at most 256
    failure_score: float  # the reward of a trajectory whose program or metric raised
    format_failure_score: float  # the reward of one with a reply that did not parse
    progress: bool  # a bar over the jobs


def run_rollouts(
    program: Module,
    examples: Sequence[Example],
    metric: Metric,
    *,
    num_rollouts: int,
    first_example: int = 0,
    key_prefix: tuple[int, ...] | None = None,
    **options: Unpack[RolloutOptions],
) -> list[Trajectory]:
    """G trajectories per example on a thread pool, ordered by (example, rollout).

    All rollouts are submitted at once so a batching LM sees many concurrent requests; by default
    there is one worker per rollout (at most 256). Example i is numbered `first_example` + i
    (a process sampling its share of a step numbers its examples as in the whole step); with
    `key_prefix` the samples are keyed by (*key_prefix, example, rollout, call).
    """
    if num_rollouts < 1:
        raise ValueError(f"num_rollouts must be >= 1, got {num_rollouts}")
    jobs = [
        RolloutJob(program, example, first_example + e, r)
        for e, example in enumerate(examples)
        for r in range(num_rollouts)
    ]
    return run_jobs(jobs, metric, key_prefix=key_prefix, **options)


def run_pairs(
    pairs: Sequence[tuple[Module, Example]],
    metric: Metric,
    *,
    on_result: Callable[[Trajectory], None] | None = None,
    **options: Unpack[RolloutOptions],
) -> list[Trajectory]:
    """One run of each (program, example) pair, all on one thread pool; trajectory i (its
    example_index) is pair i's. Different programs (prompt candidates, teachers) share the LM's
    batches this way instead of taking turns. `on_result` sees each trajectory as it finishes
    (in the calling thread), so a caller keeps what finished if the run is interrupted."""
    jobs = [RolloutJob(program, example, i, 0) for i, (program, example) in enumerate(pairs)]
    return run_jobs(jobs, metric, on_result=on_result, **options)


@dataclasses.dataclass(frozen=True)
class RolloutJob:
    """One trajectory to run: which program on which example, its indices, any calls to
    replay."""

    program: Module
    example: Example
    example_index: int
    rollout_index: int
    replay: tuple[CallRecord, ...] = ()


def run_jobs(
    jobs: Sequence[RolloutJob],
    metric: Metric,
    *,
    on_result: Callable[[Trajectory], None] | None = None,
    key_prefix: tuple[int, ...] | None = None,
    lm: LM | None = None,
    max_workers: int | None = None,
    failure_score: float = 0.0,
    format_failure_score: float = -1.0,
    progress: bool = False,
) -> list[Trajectory]:
    """The jobs' trajectories, in job order, on one thread pool (see `run_rollouts`; the last
    five are `RolloutOptions`)."""
    for spec in jobs:
        # fail here, not in a worker thread, on a row without input keys or the program's
        spec.program.check_inputs(spec.example.inputs(), f"example {spec.example_index}")
    if not jobs:
        return []
    workers = max_workers if max_workers is not None else min(len(jobs), 256)

    # A batching LM waits until every busy worker has a request queued, so it is told how many
    # workers are busy: min(workers, unfinished jobs), registered before any job starts (else the
    # first request would be sent alone) and lowered as the last jobs finish.
    batching = isinstance(lm, BatchingLM)
    lock = threading.Lock()
    finished, registered = [0], [min(workers, len(jobs)) if batching else 0]
    for _ in range(registered[0]):
        lm.open_client()

    def job(spec: RolloutJob) -> Trajectory:
        try:
            return run_trajectory(
                spec.program,
                spec.example,
                metric,
                example_index=spec.example_index,
                rollout_index=spec.rollout_index,
                lm=lm,
                failure_score=failure_score,
                format_failure_score=format_failure_score,
                key_prefix=key_prefix,
                replay=spec.replay,
            )
        finally:
            with lock:
                busy_before = min(workers, len(jobs) - finished[0])
                finished[0] += 1
                busy_after = min(workers, len(jobs) - finished[0])
                release = registered[0] > 0 and busy_after < busy_before
                registered[0] -= release
            if release:
                lm.close_client()

    def release_all() -> None:
        """An abandoned run gives its clients back at once (cancelled jobs never finish)."""
        with lock:
            count, registered[0] = registered[0], 0
        for _ in range(count):
            lm.close_client()

    # Not `with`: an interrupt must not wait for the running jobs (their LM calls fail once
    # the engine is closed); the queued ones are cancelled.
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rollout")
    results: list[Trajectory | None] = [None] * len(jobs)
    try:
        futures = {pool.submit(job, spec): i for i, spec in enumerate(jobs)}
        bar = tqdm(total=len(jobs), desc="rollouts", disable=not progress, leave=False)
        with bar:
            for future in as_completed(futures):
                trajectory = future.result()
                if trajectory.error is not None:
                    logger.warning(
                        "example %d rollout %d: %s",
                        trajectory.example_index,
                        trajectory.rollout_index,
                        trajectory.error,
                    )
                results[futures[future]] = trajectory
                if on_result is not None:
                    on_result(trajectory)
                bar.update()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        release_all()
        raise
    pool.shutdown()
    return results


def score_examples(
    program: Module,
    examples: Sequence[Example],
    metric: Metric,
    *,
    lm: LM | None = None,
    progress: bool = False,
    on_result: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """One run per example where every failure scores 0: evaluation must not reward (or, with a
    negative format_failure_score, punish harder) a broken format."""
    pairs = [(program, e) for e in examples]
    return score_pairs(pairs, metric, lm=lm, progress=progress, on_result=on_result)


def score_pairs(
    pairs: Sequence[tuple[Module, Example]],
    metric: Metric,
    *,
    lm: LM | None = None,
    progress: bool = False,
    on_result: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """`score_examples` for (program, example) pairs: several programs in one pool."""
    return run_pairs(
        pairs,
        metric,
        lm=lm,
        failure_score=0.0,
        format_failure_score=0.0,
        progress=progress,
        on_result=on_result,
    )


@contextlib.contextmanager
def quiet_failure_warnings() -> Iterator[None]:
    """Silence the per-trajectory warnings for callers that report every status themselves."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def summarize(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Counts by status and the mean reward: what a run log needs about its rollouts."""
    counts = {status: 0 for status in ("ok", "format_failure", "error")}
    for t in trajectories:
        counts[t.status] += 1
    rewards = [t.reward for t in trajectories]
    return {
        "trajectories": len(trajectories),
        **{f"status_{k}": v for k, v in counts.items()},
        "reward_mean": sum(rewards) / len(rewards) if rewards else float("nan"),
        "calls": sum(len(t.calls) for t in trajectories),
    }
