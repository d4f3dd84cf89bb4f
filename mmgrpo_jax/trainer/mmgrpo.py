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

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
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
from mmgrpo_jax.engines.lm import EngineLM, module_adapters
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
from mmgrpo_jax.rl.rollout import run_rollouts, score_examples
from mmgrpo_jax.rl.step import (
    ROW_METRIC,
    ROW_SAMPLER_KEYS,
    gradient_is_zero,
    make_idle_step,
    make_logprob_fn,
    make_train_step,
    split_for_training,
)
from mmgrpo_jax.rl.types import Metric, Trajectory
from mmgrpo_jax.trainer.config import MMGRPOConfig, OptimConfig, SamplerConfig
from mmgrpo_jax.trainer.learner import Guard, Learner
from mmgrpo_jax.trainer.policy import (
    EngineFactory,
    apply_memory_settings,
    default_engine,
    engine_or_factory,
    load_policy,
)
from mmgrpo_jax.trainer.run import Run
from mmgrpo_jax.trainer.run_log import RunLogger
from mmgrpo_jax.trainer.samples import step_samples
from mmgrpo_jax.trainer.step_metrics import step_metrics
from models.decoder import Decoder
from models.sharding import batch_multiple, placed_state, shard_model
from models.tokenizer import HFTokenizer

__all__ = [
    "MMGRPO",
    "MMGRPOConfig",
    "OptimConfig",
    "SamplerConfig",
    "evaluate",
]


logger = logging.getLogger(__name__)


def examples_for_step(num_examples: int, per_step: int, step: int, seed: int) -> list[int]:
    """Indices of the step's examples: a fresh seeded permutation every epoch, no state."""
    indices = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        indices.append(int(order[offset]))
    return indices


def evaluate(program: Module, examples: Sequence[Example], metric: Metric, lm: LM) -> float:
    """Mean greedy reward; failures score 0 here so that a broken format is not rewarded. With
    several processes each scores its share and all get the mean (every process must call)."""
    if not examples:
        return float("nan")
    mine = parallel.share(examples)
    scored = score_examples(program, examples[mine.start : mine.stop], metric, lm=lm)
    return float(np.mean(parallel.gather_lists([t.reward for t in scored])))


def _is_dspy_module(program: object) -> bool:
    """Without importing dspy: a dspy.Module can exist only once dspy was imported."""
    dspy = sys.modules.get("dspy")
    return dspy is not None and isinstance(program, getattr(dspy, "Module", ()))


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
        self.engine, self._engine_factory = engine_or_factory(engine)
        self.trainable = config.trainable
        self.run_dir = Path(config.run_dir)
        self.log: RunLogger | None = None
        self.summary: dict[str, Any] | None = None  # summary.json's content, after compile

    # -- the public entry point: docs/design.md#architecture ------------------------------------
    def compile(self, program: Any, trainset: Sequence[Any], valset: Sequence[Any] = ()) -> Any:
        """Train the policy behind `program`'s predictors and return the program. The algorithm
        (docs/design.md#architecture), one step at a time:

            for step in steps:
                examples = the step's examples_per_step (a seeded permutation per epoch)
                trajectories = G rollouts of program on each example, scored by metric
                groups = grouping rule (module: the k-th calls of each module across the G
                         rollouts of an example; trajectory: the G trajectories)
                advantages = (r - mean(group)) / (std(group) + eps), per group
                rows = one (prompt ids, completion ids, advantage) per call of each member
                state = update(state, rows)  (num_iterations passes of the loss over them)
                engine.update_weights(state.trainable)

        `_rollouts` is the first five lines, `_learn` the last two; what makes the loop safe to
        stop and resume is `Run`'s (trainer/run.py). A `dspy.Module` with `dspy.Example`s and a
        DSPy metric trains through `mmgrpo_jax.interop.dspy` and comes back as a DSPy program
        on the trained policy."""
        if _is_dspy_module(program):
            from mmgrpo_jax.interop import dspy as dspy_interop

            return dspy_interop.train(self, program, trainset, valset)
        cfg = self.config
        self._check_data(cfg, program, trainset, valset)
        with ExitStack() as closing:
            run = Run(self, program, closing)
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
        self, rollouts: _StepRollouts, lm: EngineLM, learner: Learner, guard: Guard, step: int
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
        self, learner: Learner, batch: Batch, guard: Guard, step: int, rows: Sequence[Row]
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

    def _idle_update(self, learner: Learner, batch: Batch) -> dict[str, float]:
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

    def _learner(self) -> Learner:
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
        return Learner(state, frozen, step_fn, logprob_fn, idle_fn)

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
