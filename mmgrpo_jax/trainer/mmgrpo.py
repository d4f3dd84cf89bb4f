"""The mmGRPO optimizer: rollouts -> rewards -> groups -> advantages -> update, step after step.

`MMGRPO(metric, config).compile(program, trainset, valset)` trains the policy behind every
predictor of `program` (one shared LoRA adapter, or one per module: `lora.modules`) and
returns the program. The policy is loaded from `config.model_path` or passed in (`model=`,
`tokenizer=`, `stop_token_ids=`); rollouts go through a rollout engine (`engine=`: an engine, a
factory `model -> engine`, or by default the continuous engine on the policy) that receives the
new trainable weights after every update. All state a resumed run needs goes into a checkpoint
(trainer.checkpoint); the data order is a pure function of (seed, step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from mmgrpo_jax import parallel
from mmgrpo_jax.engines.base import EngineStats, RolloutEngine, Sampling
from mmgrpo_jax.engines.continuous import DEFAULT_PREFILL_CHUNK, ContinuousEngine
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.engines.lm import EngineLM, module_adapters
from mmgrpo_jax.engines.local import LocalEngine
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.rl.advantages import advantages_for_groups
from mmgrpo_jax.rl.batch import (
    Batch,
    PackShape,
    Row,
    batch_layout,
    pack_rows,
    pack_shape,
    rows_from_groups,
)
from mmgrpo_jax.rl.grouping import Group, GroupingSettings, grouping_rule
from mmgrpo_jax.rl.rollout import run_rollouts, score_examples, summarize
from mmgrpo_jax.rl.step import (
    ROW_METRIC,
    ROW_SAMPLER_KEYS,
    FrozenWeights,
    TrainState,
    TrainStep,
    gradient_is_zero,
    make_idle_step,
    make_logprob_fn,
    make_train_step,
    split_for_training,
)
from mmgrpo_jax.rl.types import Metric, Trajectory
from mmgrpo_jax.trainer.checkpoint import Checkpointer, Restored, refuse_foreign_checkpoints
from mmgrpo_jax.trainer.config import (
    DistributedConfig,
    MemoryConfig,
    MMGRPOConfig,
    OptimConfig,
    ParallelConfig,
    SamplerConfig,
    changed_keys,
    describe_changes,
    field_defaults,
    flatten,
)
from mmgrpo_jax.trainer.interrupt import Interrupted, StopSignals
from mmgrpo_jax.trainer.run_lock import RunLock
from mmgrpo_jax.trainer.run_log import RunLogError, RunLogger, read_json
from mmgrpo_jax.trainer.samples import step_samples
from models.decoder import Decoder
from models.export import save_peft_adapter
from models.hf import load_checkpoint
from models.sharding import batch_multiple, placed_state, shard_model
from models.tokenizer import HFTokenizer

__all__ = [
    "MMGRPO",
    "MMGRPOConfig",
    "OptimConfig",
    "SamplerConfig",
    "check_run_dir",
    "default_engine",
    "evaluate",
    "load_policy",
]

logger = logging.getLogger(__name__)

EngineFactory = Callable[[Decoder], RolloutEngine]


def load_policy(config: MMGRPOConfig) -> tuple[Decoder, HFTokenizer, tuple[int, ...]]:
    """Model (with a fresh LoRA adapter unless training in full), tokenizer and stop ids."""
    if config.model_path is None:
        raise ValueError("MMGRPOConfig.model_path is not set and no model was passed in")
    model, tokenizer, stop = load_checkpoint(
        config.model_path,
        dtype=jnp.dtype(config.dtype),
        lora=config.lora if config.train == "lora" else None,
        lora_seed=config.seed,
    )
    apply_memory_settings(model, config)  # before any engine splits it (its graphdef is fixed)
    return model, tokenizer, stop


def apply_memory_settings(model: Decoder, config: MMGRPOConfig) -> Decoder:
    """The config's attention and remat on the model: static parts of its graph, so an engine
    split from it earlier keeps the old ones."""
    model.attention = config.memory.attention_config
    model.remat = config.memory.remat
    return model


def examples_for_step(num_examples: int, per_step: int, step: int, seed: int) -> list[int]:
    """Indices of the step's examples: a fresh seeded permutation every epoch, no state."""
    indices = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        indices.append(int(order[offset]))
    return indices


def default_engine(
    model: Decoder,
    stop_token_ids: Sequence[int],
    config: MMGRPOConfig,
    mesh: jax.sharding.Mesh | None = None,
) -> LocalEngine:
    """The engine a run samples through unless given another (`sampler.engine`): the config's
    slots or batch, wait and seed, receiving the trainable part of the model; rows split over
    the mesh's data x fsdp devices when given one."""
    sampler = config.sampler
    common = {
        "stop_token_ids": stop_token_ids,
        "trainable": config.trainable,
        "max_wait_s": sampler.max_wait_s,
        "seed": config.seed,
        "mesh": mesh,
        "max_cache_tokens": sampler.max_cache_tokens,
    }
    chunk = config.memory.prefill_chunk
    if sampler.engine == "continuous":
        return ContinuousEngine(
            model,
            slots=sampler.batch,
            decode_steps=sampler.decode_steps,
            prefix_sharing=sampler.prefix_sharing,
            prefill_chunk=chunk or DEFAULT_PREFILL_CHUNK,
            **common,
        )
    return JaxEngine(model, max_batch=sampler.batch, prefill_chunk=chunk, **common)


def check_run_dir(config: MMGRPOConfig) -> None:
    """What `compile` would refuse about config.run_dir (another run holds it; a fresh run
    into another run's checkpoints), checked before a model is loaded (by process 0: the
    others share its run_dir)."""
    if not parallel.is_main_process():
        return
    with RunLock(config.run_dir):
        refuse_foreign_checkpoints(config.run_dir, config.resume)


def evaluate(program: Module, examples: Sequence[Example], metric: Metric, lm: LM) -> float:
    """Mean greedy reward; failures score 0 here so that a broken format is not rewarded. With
    several processes each scores its share and all get the mean (every process must call)."""
    if not examples:
        return float("nan")
    mine = parallel.share(examples)
    scored = score_examples(program, examples[mine.start : mine.stop], metric, lm=lm)
    return float(np.mean(parallel.gather_lists([t.reward for t in scored])))


def step_metrics(
    trajectories: Sequence[Trajectory],
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    update: dict[str, float],
    seconds: dict[str, float],
    engine: EngineStats,
) -> dict[str, float]:
    """Everything a step logs, gathered in one place. `engine`: the step's share of the
    engine's stats (where the rollouts' time went: sampling, or the programs and tools)."""
    metrics: dict[str, float] = {k: float(v) for k, v in summarize(trajectories).items()}
    metrics["reward_std"] = float(np.std([t.reward for t in trajectories]))
    sampled = sum(
        len(c.completion_ids or ()) for t in trajectories for c in t.calls if not c.replayed
    )
    metrics["rollout_tokens_per_s"] = sampled / max(seconds["rollout"], 1e-9)
    metrics["groups"] = float(len(groups))
    # calls answered from another rollout's record, not sampled (branch rollouts' shared prefix)
    metrics["calls_replayed"] = float(sum(c.replayed for t in trajectories for c in t.calls))
    metrics.update(group_diagnostics(groups, advantages))
    lengths: dict[str, list[int]] = {}
    grouped: set[int] = set()
    for group in groups:
        for member in group.members:
            for call in member.calls:
                if id(call) not in grouped:
                    lengths.setdefault(call.predictor, []).append(len(call.completion_ids or ()))
                grouped.add(id(call))
    for name, values in lengths.items():
        metrics[f"completion_length/{name}"] = float(np.mean(values))
    # calls that gave no training row, and why: in no group (the alignment dropped them, or a
    # branch rollout shares them), or nothing generated
    ungrouped: Counter[str] = Counter()
    empty: Counter[str] = Counter()
    for t in trajectories:
        for call in t.calls:
            ungrouped[call.predictor] += id(call) not in grouped
            empty[call.predictor] += id(call) in grouped and not call.completion_ids
    for name in sorted(ungrouped):
        metrics[f"calls_ungrouped/{name}"] = float(ungrouped[name])
        metrics[f"calls_empty/{name}"] = float(empty[name])
    metrics.update({f"time/{k}": v for k, v in seconds.items()})
    if update:
        metrics.update(update)
        metrics["train_tokens_per_s"] = update["tokens"] / max(seconds["train"], 1e-9)
    metrics["sampler_occupancy"] = engine.occupancy
    metrics["time/queue_wait"] = engine.mean_queue_wait_s  # per request, submit to start
    # programs compiled by the engine in this step (a resumed run compiles its shapes again)
    metrics["perf/sampler_compiles"] = float(engine.compiles)
    # prefill saved: prompt tokens whose keys and values were copied from a slot that held them
    metrics["sampler_prompt_tokens"] = float(engine.prompt_tokens)
    metrics["sampler_shared_prefix_tokens"] = float(engine.shared_prefix_tokens)
    metrics["sampler_prefill_saved"] = engine.prefill_saved
    # the engine's own seconds in sampler calls; the rest of the rollouts' wall time is the
    # programs' (and their tools') time not hidden behind sampling
    metrics["time/sampling"] = engine.sample_s
    metrics["time/program"] = max(seconds["rollout"] - engine.sample_s, 0.0)
    return metrics


def group_diagnostics(
    groups: Sequence[Group], advantages: Sequence[np.ndarray]
) -> dict[str, float]:
    """Per module (and per (module, invocation) for a module called several times in a
    trajectory; "trajectory" for trajectory-level groups): how many groups, the fraction with no
    reward spread (no gradient), the mean number of distinct members (below G when padding or
    select-K repeated some), and the advantages' mean and spread."""
    by_key: dict[str, list[tuple[Group, np.ndarray]]] = {}
    invocations: dict[str, set[int]] = {}
    for group, adv in zip(groups, advantages, strict=True):
        name = group.module or "trajectory"
        by_key.setdefault(name, []).append((group, adv))
        if group.invocation is not None:
            invocations.setdefault(name, set()).add(group.invocation)
            by_key.setdefault(f"{name}#{group.invocation}", []).append((group, adv))
    metrics = {}
    for key, items in by_key.items():
        module, _, invocation = key.partition("#")
        if invocation and len(invocations.get(module, ())) < 2:
            continue  # one invocation: the module's own numbers say it all
        values = np.concatenate([adv for _, adv in items])
        distinct = [len({m.rollout_index for m in g.members}) for g, _ in items]
        metrics[f"groups/{key}"] = float(len(items))
        metrics[f"zero_variance_fraction/{key}"] = float(
            np.mean([not np.any(adv) for _, adv in items])
        )
        metrics[f"distinct_members/{key}"] = float(np.mean(distinct))
        metrics[f"advantage_mean/{key}"] = float(np.mean(values))
        metrics[f"advantage_std/{key}"] = float(np.std(values))
    return metrics


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


ENGINE_METHODS = (
    "submit",
    "update_weights",
    "stats",
    "state_dict",
    "load_state_dict",
    "open_client",
    "close_client",
    "close",
)


def _is_dspy_module(program: object) -> bool:
    """Without importing dspy: a dspy.Module can exist only once dspy was imported."""
    dspy = sys.modules.get("dspy")
    return dspy is not None and isinstance(program, getattr(dspy, "Module", ()))


def _engine_or_factory(
    engine: RolloutEngine | EngineFactory | None,
) -> tuple[RolloutEngine | None, EngineFactory | None]:
    """(a shared engine, None), (None, a factory), or (None, None) for the default JaxEngine."""
    if engine is None:
        return None, None
    if not isinstance(engine, type) and isinstance(engine, RolloutEngine):
        return engine, None
    if callable(engine):
        return None, engine
    missing = [m for m in ENGINE_METHODS if not hasattr(engine, m)]
    raise TypeError(
        f"MMGRPO engine= must be a RolloutEngine or a factory model -> engine; {engine!r} lacks "
        f"{missing}"
    )


def _give_back(model: Decoder, state: TrainState) -> None:
    """The trained weights into the model, unless a failed update left them donated."""
    if any(leaf.is_deleted() for leaf in jax.tree.leaves(state.trainable)):
        logger.error(
            "the model keeps its weights from before the run: the update that failed "
            "had consumed the train state"
        )
        return
    nnx.update(model, parallel.local_copy(state.trainable))


@dataclasses.dataclass(frozen=True)
class _StepRollouts:
    """What a step's rollouts produce, before any state changes."""

    trajectories: list[Trajectory]
    groups: list[Group]
    advantages: list[np.ndarray]
    rows: list[Row]
    seconds: dict[str, float]
    engine: EngineStats  # the step's share of the engine's stats
    samples: list[dict[str, Any]]  # what samples.jsonl gets of the step (trainer.samples)


class _Guard:
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
class _Learner:
    """The jitted functions of a run and the state they pass along."""

    state: TrainState
    frozen: FrozenWeights
    step_fn: TrainStep
    logprob_fn: Callable
    idle_fn: Callable[[TrainState], TrainState]

    def compiles(self) -> int:
        """Programs compiled so far by the learner's jitted functions (all shapes)."""
        return sum(fn._cache_size() for fn in (self.step_fn, self.logprob_fn, self.idle_fn))


def _check_prompts_unchanged(before: dict[str, Any], after: dict[str, Any], step: int) -> None:
    """A program whose forward changes its own predictors' prompts (demos, instructions) is
    refused: its G rollouts run concurrently on one object, so they would see each other's
    changes, and the prompts trained and saved would not be the ones sampled."""
    changed = sorted(
        name for name in before.keys() | after.keys() if before.get(name) != after.get(name)
    )
    if changed:
        raise UserError(
            f"the program changed its own predictors {changed} (their demos or instructions) "
            f"while the rollouts of step {step + 1} ran: a forward must leave the program as it "
            "was (rollouts share it on several threads); keep per-call state in locals"
        )


class MMGRPO:
    """The optimizer; see the module doc."""

    def __init__(
        self,
        metric: Metric,
        config: MMGRPOConfig,
        *,
        model: Decoder | None = None,
        tokenizer: HFTokenizer | None = None,
        stop_token_ids: Sequence[int] | None = None,
        engine: RolloutEngine | EngineFactory | None = None,
    ) -> None:
        parallel.initialize(config.distributed)  # before any device is touched
        if model is None:
            model, tokenizer, stop_token_ids = load_policy(config)
        elif tokenizer is None or stop_token_ids is None:
            raise ValueError("a model passed in needs its tokenizer and stop_token_ids too")
        if config.train == "lora" and model.lora is None:
            raise ValueError("train='lora' needs a model built with a LoRA adapter (lora=...)")
        per_module = config.per_module_adapters or (
            config.train == "lora" and model.lora.num_adapters > 1
        )
        if per_module and model.lora.rules != config.lora.rules:
            raise ValueError(
                f"the model's LoRA modules {list(model.lora.modules)} are not the config's "
                f"{list(config.lora.modules)} (lora.modules routes each predictor to its "
                "adapter); build the model with the config's LoRAConfig"
            )
        # static parts of the model's graph: the train step, the log-prob pass and the default
        # engine (split in compile) run with them; an engine passed in was split before
        apply_memory_settings(model, config)
        self.mesh = parallel.run_mesh(config.parallel)
        shards = batch_multiple(self.mesh)
        if config.optim.micro_batch_size % shards:
            raise UserError(
                f"MMGRPOConfig.optim.micro_batch_size={config.optim.micro_batch_size} does not "
                f"split over the mesh's data x fsdp = {shards} devices; make it a multiple of "
                f"{shards} or set parallel.data"
            )
        # One process: the model itself goes onto the mesh (the engine samples on it). Several:
        # the model stays on this process's devices for its engine, and training gets a copy
        # on the global mesh (sharing this process's first device's buffers).
        self._local_engine = jax.process_count() > 1
        if not self._local_engine:
            shard_model(model, self.mesh)
        self.metric, self.config, self.model, self.tokenizer = metric, config, model, tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.engine, self._engine_factory = _engine_or_factory(engine)
        self.trainable = config.trainable
        self.run_dir = Path(config.run_dir)
        self.log: RunLogger | None = None
        self.summary: dict[str, Any] | None = None  # summary.json's content, after compile

    # -- the public entry point: docs/design.md#architecture ------------------------------------
    def compile(self, program: Any, trainset: Sequence[Any], valset: Sequence[Any] = ()) -> Any:
        """Train the policy behind `program`'s predictors. Each step is rollouts -> groups ->
        advantages -> rows (`_rollouts`), then update -> weight sync (`_learn`); what makes the
        loop safe to stop and resume is `_Run`'s. A `dspy.Module` with `dspy.Example`s and a
        DSPy metric trains through `mmgrpo_jax.interop.dspy` and comes back as a DSPy program
        on the trained policy."""
        if _is_dspy_module(program):
            from mmgrpo_jax.interop import dspy as dspy_interop

            return dspy_interop.train(self, program, trainset, valset)
        cfg = self.config
        self._check_data(cfg, program, trainset, valset)
        with ExitStack() as closing:
            run = _Run(self, program, closing)
            if run.finished:
                return program
            with run.saving_on_stop():
                for step in run.steps():
                    if step % cfg.eval_every == 0 and valset:
                        self._evaluate(program, valset, run.greedy, step)  # once, resumed or not
                    rollouts = self._rollouts(program, trainset, run.lm, step)
                    run.check_rollouts(rollouts.trajectories, step)
                    with run.completing(step) as done:  # a signal waits for the update
                        record = self._learn(rollouts, run.lm, run.learner, run.guard, step)
                        done(record, rollouts.samples)
                if valset:
                    self._evaluate(program, valset, run.greedy, run.done)
            self.summary = run.finish()
        return program

    # -- weights, for BetterTogether ---------------------------------------------------------
    def snapshot_weights(self) -> nnx.State:
        """A host copy of the trainable parameters (LoRA, or all in "full" mode)."""
        return jax.tree.map(np.array, nnx.state(self.model, self.trainable))

    def restore_weights(self, snapshot: nnx.State) -> None:
        weights = jax.tree.map(jnp.asarray, snapshot)
        nnx.update(self.model, weights)
        if self.engine is not None:  # a shared engine samples from the restored weights too
            self.engine.update_weights(weights)

    # -- one step ------------------------------------------------------------------------------
    def _rollouts(
        self, program: Module, trainset: Sequence[Example], lm: EngineLM, step: int
    ) -> _StepRollouts:
        """The step's trajectories, groups, advantages and training rows; no state changes."""
        cfg = self.config
        rule = grouping_rule(cfg.grouping)
        stats_before = dataclasses.replace(lm.stats)
        start = time.perf_counter()
        chosen = [
            trainset[i]
            for i in examples_for_step(len(trainset), cfg.examples_per_step, step, cfg.seed)
        ]
        mine = parallel.share(chosen)  # this process's examples of the step (all, alone)
        settings = GroupingSettings(
            cfg.num_rollouts,
            cfg.align,
            cfg.select_k,
            cfg.seed + step,
            cfg.branch_module,
            cfg.branch_invocation,
        )
        run = dict(
            num_rollouts=cfg.num_rollouts,
            lm=lm,
            failure_score=cfg.failure_score,
            format_failure_score=cfg.format_failure_score,
            first_example=mine.start,
            key_prefix=(step,),  # samples keyed by (seed, step, example, rollout, call)
        )
        mine_examples = chosen[mine.start : mine.stop]
        prompts_before = program.dump_state()
        if rule.rollouts is None:
            trajectories = run_rollouts(program, mine_examples, self.metric, **run)
        else:  # the rule makes its own (branch rollouts)
            trajectories = rule.rollouts(
                program, mine_examples, self.metric, settings=settings, **run
            )
        seconds = {"rollout": time.perf_counter() - start}
        _check_prompts_unchanged(prompts_before, program.dump_state(), step)
        # every process groups and trains on the whole step's trajectories
        trajectories = parallel.gather_lists(trajectories)
        groups = rule.group(trajectories, settings)
        advantages = advantages_for_groups(groups, cfg.advantage_scale)
        rows = rows_from_groups(
            groups,
            advantages,
            unit=cfg.row_unit,
            mask_truncated_completions=cfg.mask_truncated_completions,
            adapter_of=self._adapter_of,
        )
        engine = lm.stats.since(stats_before)  # this step's rollouts only
        samples = step_samples(
            step + 1,
            trajectories,
            groups,
            advantages,
            examples=cfg.samples_per_step,
            mask_truncated_completions=cfg.mask_truncated_completions,
        )
        return _StepRollouts(trajectories, groups, advantages, rows, seconds, engine, samples)

    def _learn(
        self, rollouts: _StepRollouts, lm: EngineLM, learner: _Learner, guard: _Guard, step: int
    ) -> dict[str, float]:
        """Update on the step's rows, send the engine the new weights; the step's log row."""
        cfg = self.config
        seconds = dict(rollouts.seconds)
        update: dict[str, float] = {}
        if rollouts.rows:
            start = time.perf_counter()
            batch = pack_rows(
                rollouts.rows,
                cfg.optim.micro_batch_size,
                row_multiple=batch_multiple(self.mesh),
                num_adapters=cfg.lora.num_adapters if cfg.per_module_adapters else 1,
                **self._packing(rollouts.rows),
            )
            padding = batch.padding_fraction
            row_tokens = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts.rows)
            # the tokens the forward pass holds, against the rows' own (below 1: shared prompts)
            forward_share = float(np.asarray(batch.valid).sum()) / row_tokens
            seconds["pack"] = time.perf_counter() - start
            compiles = learner.compiles()
            if gradient_is_zero([row.advantage for row in rollouts.rows], cfg.resolved_loss):
                update = self._idle_update(learner, batch)
            else:
                batch = parallel.place_batch(batch, self.mesh)
                update = self._update(learner, batch, guard, step, rollouts.rows)
            update.setdefault("idle_update", 0.0)
            update["padding_fraction"] = padding
            update["forward_token_share"] = forward_share
            # what the loss normalised by: rows, trajectories or examples (loss_unit)
            update["loss_units"] = float(len({row.unit for row in rollouts.rows}))
            update["perf/train_compiles"] = float(learner.compiles() - compiles)
            synced = time.perf_counter()
            # the next rollouts use the update (each process's engine holds local arrays)
            lm.engine.update_weights(parallel.local_copy(learner.state.trainable))
            seconds["weight_sync"] = time.perf_counter() - synced
            seconds["train"] = time.perf_counter() - start
        else:
            logger.warning("step %d produced no training rows; skipping the update", step + 1)
        metrics = step_metrics(
            rollouts.trajectories,
            rollouts.groups,
            rollouts.advantages,
            update,
            seconds,
            rollouts.engine,
        )
        record = {"step": float(step + 1), "lr": float(cfg.optim.schedule(cfg.num_steps)(step))}
        return {**record, **metrics}

    def _update(
        self, learner: _Learner, batch: Batch, guard: _Guard, step: int, rows: Sequence[Row]
    ) -> dict[str, float]:
        """num_iterations updates on one batch; old log-probs are those before the first. The
        step refuses (keeps the old state for) an update whose loss, gradient norm or new
        weights are not finite; the guard stops the run after too many in a row."""
        state = learner.state
        started = time.perf_counter()
        logprob_s = 0.0
        if self.config.num_iterations > 1:  # with one, the step's own pass gives the old ones
            old = jax.block_until_ready(learner.logprob_fn(state.trainable, learner.frozen, batch))
            batch = batch.replace(old_logps=old)
            logprob_s = time.perf_counter() - started
        first, skipped, per_module = None, 0, {}
        for _ in range(self.config.num_iterations):
            state, metrics = learner.step_fn(state, learner.frozen, batch)
            learner.state = state  # the old one is donated: this is the only live state now
            metrics = jax.device_get(metrics)
            per_row = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith(ROW_METRIC)]}
            metrics = {k: float(v) for k, v in metrics.items()}
            if first is None:  # the weights compare the sampler with the step's old log-probs
                first, per_module = metrics, self._per_module_row_metrics(rows, per_row)
            applied = bool(metrics.pop("update_applied"))
            skipped += not applied
            guard.count_update(applied, metrics, step)
        # the gap is measured before any update of this step: the first iteration's
        metrics["sampler_logprob_gap"] = first["sampler_logprob_gap"]
        metrics.update(per_module)
        metrics["skipped_updates"] = float(skipped)
        metrics["time/logprob"] = logprob_s
        metrics["time/update"] = time.perf_counter() - started - logprob_s
        return metrics

    def _idle_update(self, learner: _Learner, batch: Batch) -> dict[str, float]:
        """The step's updates when its gradient is zero (every advantage 0, beta = 0): the
        optimizer applied to zeros, no pass over the rows (make_idle_step)."""
        started = time.perf_counter()
        for _ in range(self.config.num_iterations):
            learner.state = learner.idle_fn(learner.state)
        jax.block_until_ready(learner.state)
        tokens = float(np.sum(np.asarray(batch.loss_mask)))
        return {
            "idle_update": 1.0,
            "loss": 0.0,
            "grad_norm": 0.0,
            "tokens": tokens,
            "skipped_updates": 0.0,
            "time/logprob": 0.0,
            "time/update": time.perf_counter() - started,
        }

    # -- set-up and teardown -------------------------------------------------------------------
    @staticmethod
    def _check_data(
        cfg: MMGRPOConfig,
        program: Module,
        trainset: Sequence[Example],
        valset: Sequence[Example],
    ) -> None:
        if cfg.examples_per_step > len(trainset):
            raise UserError(
                f"MMGRPOConfig.examples_per_step={cfg.examples_per_step} is larger than the "
                f"trainset ({len(trainset)} examples)"
            )
        predictors = [name for name, _ in program.named_predictors()]
        if cfg.lora.modules:  # one adapter too: a pattern must still name the program's modules
            try:
                cfg.lora.check_predictors(predictors)
            except ValueError as err:
                raise UserError(str(err)) from None
        if cfg.grouping == "branch" and cfg.branch_module not in predictors:
            raise UserError(
                f"MMGRPOConfig.branch_module={cfg.branch_module!r} is not a predictor of the "
                f"program: {predictors}"
            )
        # every row must name inputs the program takes before any compute
        for name, rows in (("trainset", trainset), ("valset", valset)):
            for i, example in enumerate(rows):
                try:
                    program.check_inputs(example.inputs(), f"{name}[{i}]")
                except ValueError as err:
                    raise UserError(str(err)) from None

    def _learner(self) -> _Learner:
        cfg = self.config
        optimizer = cfg.optim.build(cfg.num_steps)
        # "full" training has no LoRA-off base to measure KL against: a frozen copy of the start
        frozen_reference = cfg.train == "full" and cfg.loss.beta > 0
        graphdef, state, frozen = split_for_training(
            self._training_model(),
            optimizer,
            self.trainable,
            seed=cfg.seed,
            frozen_reference=frozen_reference,
        )
        # counters and keys replicated; everything else is already placed by the rules
        state, frozen = parallel.place_replicated((state, frozen), self.mesh)
        temperature, chunk = cfg.sampler.temperature, cfg.memory.logits_chunk
        step_fn = make_train_step(
            graphdef,
            optimizer,
            cfg.resolved_loss,
            temperature,
            chunk,
            state_sharding=parallel.shardings_of(state),
        )
        idle_fn = make_idle_step(optimizer, state_sharding=parallel.shardings_of(state))
        logprob_fn = make_logprob_fn(graphdef, temperature, chunk)
        return _Learner(state, frozen, step_fn, logprob_fn, idle_fn)

    def _training_model(self) -> Decoder:
        """The model on the run's mesh: itself with one process (placed again: restore_weights
        may have put host weights into it), a placed copy with several."""
        if not self._local_engine:
            return shard_model(self.model, self.mesh)
        graphdef, state = nnx.split(self.model)
        return nnx.merge(graphdef, placed_state(state, self.mesh))

    def _open_engine(self, closing: ExitStack) -> RolloutEngine:
        if self.engine is not None:
            return self.engine
        if self._engine_factory is not None:
            engine = self._engine_factory(self.model)
        else:
            mesh = None if self._local_engine else self.mesh
            engine = default_engine(self.model, self.stop_token_ids, self.config, mesh)
        closing.callback(engine.close)
        return engine

    def _lms(self, engine: RolloutEngine) -> tuple[EngineLM, EngineLM]:
        """The rollouts' sampling LM and the evaluation's greedy one, on the same engine."""
        s = self.config.sampler
        sampling = Sampling(s.max_completion_tokens, s.temperature, s.top_p)
        greedy = dataclasses.replace(sampling, temperature=0.0)
        return tuple(
            EngineLM(
                engine,
                self.tokenizer,
                sampling=x,
                max_prompt_tokens=s.max_prompt_tokens,
                adapter_of=self._adapter_of,
            )
            for x in (sampling, greedy)
        )

    def _per_module_row_metrics(
        self, rows: Sequence[Row], per_row: dict[str, np.ndarray]
    ) -> dict[str, float]:
        """The step's per-row sums (the sampler-mismatch weight) summed per module: which
        module's calls the sampler and the trainer disagree on."""
        if not per_row:  # every process holds the whole step's rows and the metrics
            return {}
        layout, _ = batch_layout(rows, self.config.optim.micro_batch_size, **self._packing(rows))
        sums: dict[str, np.ndarray] = {}
        for m, chunk in enumerate(layout):
            for i, k in enumerate(chunk):
                values = [float(per_row[key][m, i]) for key in ROW_SAMPLER_KEYS]
                sums[rows[k].module] = sums.get(rows[k].module, 0.0) + np.asarray(values)
        metrics = {}
        for module, (weight, zeros, tokens) in sums.items():
            if tokens > 0:
                metrics[f"sampler_weight_mean/{module}"] = weight / tokens
                metrics[f"sampler_weight_zero_fraction/{module}"] = zeros / tokens
        return metrics

    def _packing(self, rows: Sequence[Row]) -> dict[str, Any]:
        """How `pack_rows` lays out this step's rows: the packed shape chosen from them (or
        padded rows), whether they share prefixes, and (bnpo, whose token mean is per
        micro-batch) whether micro-batches keep the padded layout's rows."""
        cfg = self.config
        memory = cfg.memory
        if not memory.pack:
            return {"pack": None}
        local_mean = cfg.resolved_loss.aggregation_name == "token_mean_local"
        pack = pack_shape(
            rows,
            cfg.optim.micro_batch_size,
            memory.pack_length,
            memory.share_prompts and not local_mean,
            batch_multiple(self.mesh),
        )
        if local_mean:  # each padded micro-batch's rows, in sequences of its longest row
            pack = PackShape(cfg.optim.micro_batch_size, pack.length)
        return {
            "pack": pack,
            "share_prompts": memory.share_prompts,
            "keep_micro_batches": local_mean,
        }

    @property
    def _adapter_of(self) -> Callable[[str], int] | None:
        """A predictor's adapter id with per-module adapters (else every call uses the one);
        the model's modules are the config's (checked in __init__)."""
        return module_adapters(self.model)

    def _progress(self, start: int) -> tqdm:
        cfg = self.config
        return tqdm(
            range(start, cfg.num_steps),
            desc="mmGRPO",
            disable=not cfg.progress,
            initial=start,
            total=cfg.num_steps,
        )

    def _evaluate(self, program: Module, valset: Sequence[Example], lm: LM, step: int) -> None:
        # logged at x = completed updates, so the curve starts at the untrained policy
        if parallel.process_zero_says(self.log.has("eval_reward", step)):
            return  # logged before the checkpoint this run resumed from (greedy: the same value)
        start = time.perf_counter()
        reward = evaluate(program, valset, self.metric, lm)
        self.log.log(
            {"step": float(step), "eval_reward": reward, "time/eval": time.perf_counter() - start}
        )


class _Run:
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
        closing.callback(lambda: _give_back(trainer.model, self.learner.state))
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
        self.guard = _Guard(cfg)
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
        _give_back(self.trainer.model, self.learner.state)
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
