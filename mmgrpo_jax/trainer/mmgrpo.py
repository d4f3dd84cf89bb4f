"""The mmGRPO optimizer: rollouts -> rewards -> groups -> advantages -> update, step after step.

`MMGRPO(metric, config).compile(program, trainset, valset)` trains the policy behind every
predictor of `program` (one shared LoRA adapter) and returns the program. The policy is loaded
from `config.model_path` or passed in (`model=`, `tokenizer=`, `stop_token_ids=`); rollouts go
through a rollout engine (`engine=`: an engine, a factory `model -> engine`, or by default a
`JaxEngine` on the policy) that receives the new trainable weights after every update. All state
a resumed run needs goes into a checkpoint (trainer.checkpoint); the data order is a pure
function of (seed, step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from mmgrpo_jax.engines.base import RolloutEngine, Sampling
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.rl.advantages import advantages_for_groups
from mmgrpo_jax.rl.batch import Batch, pack_rows, rows_from_groups
from mmgrpo_jax.rl.grouping import Group, GroupingSettings, grouping_rule
from mmgrpo_jax.rl.rollout import run_rollouts, score_examples, summarize
from mmgrpo_jax.rl.step import (
    FrozenWeights,
    TrainState,
    TrainStep,
    make_logprob_fn,
    make_train_step,
    split_for_training,
)
from mmgrpo_jax.rl.types import Metric, Trajectory
from mmgrpo_jax.trainer.checkpoint import Checkpointer
from mmgrpo_jax.trainer.config import MMGRPOConfig, OptimConfig, SamplerConfig
from mmgrpo_jax.trainer.run_log import RunLogger
from models.decoder import Decoder
from models.export import save_peft_adapter
from models.hf import load_checkpoint
from models.tokenizer import HFTokenizer

__all__ = [
    "MMGRPO",
    "MMGRPOConfig",
    "OptimConfig",
    "SamplerConfig",
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
    return load_checkpoint(
        config.model_path,
        dtype=jnp.dtype(config.dtype),
        lora=config.lora if config.train == "lora" else None,
        lora_seed=config.seed,
    )


def examples_for_step(num_examples: int, per_step: int, step: int, seed: int) -> list[int]:
    """Indices of the step's examples: a fresh seeded permutation every epoch, no state."""
    indices = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, num_examples)
        order = np.random.default_rng([seed, epoch]).permutation(num_examples)
        indices.append(int(order[offset]))
    return indices


def default_engine(
    model: Decoder, stop_token_ids: Sequence[int], config: MMGRPOConfig
) -> JaxEngine:
    """The JaxEngine a run samples through unless given another: the config's sampler batch,
    wait and seed, receiving the trainable part of the model."""
    return JaxEngine(
        model,
        stop_token_ids=stop_token_ids,
        trainable=config.trainable,
        max_batch=config.sampler.batch,
        max_wait_s=config.sampler.max_wait_s,
        seed=config.seed,
    )


def evaluate(program: Module, examples: Sequence[Example], metric: Metric, lm: LM) -> float:
    """Mean greedy reward; failures score 0 here so that a broken format is not rewarded."""
    if not examples:
        return float("nan")
    return float(np.mean([t.reward for t in score_examples(program, examples, metric, lm=lm)]))


def step_metrics(
    trajectories: Sequence[Trajectory],
    groups: Sequence[Group],
    advantages: Sequence[np.ndarray],
    update: dict[str, float],
    seconds: dict[str, float],
    occupancy: float,
) -> dict[str, float]:
    """Everything a step logs, gathered in one place."""
    metrics: dict[str, float] = {k: float(v) for k, v in summarize(trajectories).items()}
    metrics["reward_std"] = float(np.std([t.reward for t in trajectories]))
    sampled = sum(len(c.completion_ids or ()) for t in trajectories for c in t.calls)
    metrics["rollout_tokens_per_s"] = sampled / max(seconds["rollout"], 1e-9)
    metrics["groups"] = float(len(groups))
    per_module: Counter[str] = Counter()
    flat: Counter[str] = Counter()
    lengths: dict[str, list[int]] = {}
    for group, adv in zip(groups, advantages, strict=True):
        name = group.module or "trajectory"
        per_module[name] += 1
        flat[name] += int(not np.any(adv))
        for member in group.members:
            for call in member.calls:
                lengths.setdefault(call.predictor, []).append(len(call.completion_ids or ()))
    for name, count in per_module.items():
        metrics[f"groups/{name}"] = float(count)
        metrics[f"zero_variance_fraction/{name}"] = flat[name] / count
    for name, values in lengths.items():
        metrics[f"completion_length/{name}"] = float(np.mean(values))
    metrics.update({f"time/{k}": v for k, v in seconds.items()})
    if update:
        metrics.update(update)
        metrics["train_tokens_per_s"] = update["tokens"] / max(seconds["train"], 1e-9)
    metrics["sampler_occupancy"] = occupancy
    return metrics


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


@dataclasses.dataclass
class _Learner:
    """The jitted functions of a run and the state they pass along."""

    state: TrainState
    frozen: FrozenWeights
    step_fn: TrainStep
    logprob_fn: Callable


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
        if model is None:
            model, tokenizer, stop_token_ids = load_policy(config)
        elif tokenizer is None or stop_token_ids is None:
            raise ValueError("a model passed in needs its tokenizer and stop_token_ids too")
        if config.train == "lora" and model.lora is None:
            raise ValueError("train='lora' needs a model built with a LoRA adapter (lora=...)")
        self.metric, self.config, self.model, self.tokenizer = metric, config, model, tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.engine, self._engine_factory = _engine_or_factory(engine)
        self.trainable = config.trainable
        self.run_dir = Path(config.run_dir)
        self.log: RunLogger | None = None
        self.summary: dict[str, Any] | None = None  # summary.json's content, after compile

    # -- the public entry point: DESIGN section 3 ----------------------------------------------
    def compile(
        self, program: Module, trainset: Sequence[Example], valset: Sequence[Example] = ()
    ) -> Module:
        cfg = self.config
        self._check_data(cfg, trainset, valset)
        with ExitStack() as closing:
            checkpoints = Checkpointer(self.run_dir, resume=cfg.resume)
            closing.callback(checkpoints.close)
            self.log = RunLogger(self.run_dir)
            learner = self._learner()
            # the model gets the trained weights however the run ends (the engine has its own)
            closing.callback(lambda: nnx.update(self.model, learner.state.trainable))
            engine = self._open_engine(closing)
            lm, greedy = self._lms(engine)
            done = self._resume(checkpoints, learner, engine, program)
            # a checkpoint holds the state after the last *completed* step, the engine's included
            # (an interrupted step has already drawn from its sampling counter)
            engine_state = engine.state_dict()
            try:
                for step in self._progress(done):
                    if step % cfg.eval_every == 0 and valset:
                        self._evaluate(program, valset, greedy, step)
                    self._step(program, trainset, lm, learner, step)
                    done, engine_state = step + 1, engine.state_dict()
                    if done % cfg.checkpoint_every == 0:
                        self._save(checkpoints, done, learner, engine_state, program)
                if valset:
                    self._evaluate(program, valset, greedy, done)
                self._save(checkpoints, done, learner, engine_state, program)
            except KeyboardInterrupt:
                logger.warning("interrupted: writing a checkpoint at step %d before exiting", done)
                self._save(checkpoints, done, learner, engine_state, program)
                raise
        if cfg.train == "lora":
            save_peft_adapter(self.model, self.run_dir / "adapter")
        self.summary = self.log.close({"steps": cfg.num_steps, "grouping": cfg.grouping})
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
    def _step(
        self,
        program: Module,
        trainset: Sequence[Example],
        lm: EngineLM,
        learner: _Learner,
        step: int,
    ) -> None:
        cfg = self.config
        rule = grouping_rule(cfg.grouping)
        seconds: dict[str, float] = {}
        stats_before = dataclasses.replace(lm.stats)
        start = time.perf_counter()
        chosen = [
            trainset[i]
            for i in examples_for_step(len(trainset), cfg.examples_per_step, step, cfg.seed)
        ]
        trajectories = run_rollouts(
            program,
            chosen,
            self.metric,
            num_rollouts=cfg.num_rollouts,
            lm=lm,
            failure_score=cfg.failure_score,
            format_failure_score=cfg.format_failure_score,
        )
        seconds["rollout"] = time.perf_counter() - start
        settings = GroupingSettings(cfg.num_rollouts, cfg.align, cfg.select_k, cfg.seed + step)
        groups = rule.group(trajectories, settings)
        advantages = advantages_for_groups(groups, cfg.advantage_scale)
        rows = rows_from_groups(
            groups,
            advantages,
            unit=rule.unit,
            mask_truncated_completions=cfg.mask_truncated_completions,
        )
        occupancy = lm.stats.since(stats_before).occupancy  # this step's rollouts only
        update: dict[str, float] = {}
        new_state = learner.state
        if rows:
            start = time.perf_counter()
            batch = pack_rows(rows, cfg.optim.micro_batch_size)
            new_state, update = self._update(learner, batch)
            lm.engine.update_weights(new_state.trainable)  # the next rollouts use the update
            seconds["train"] = time.perf_counter() - start
        else:
            logger.warning("step %d produced no training rows; skipping the update", step + 1)
        metrics = step_metrics(trajectories, groups, advantages, update, seconds, occupancy)
        record = {"step": float(step + 1), "lr": float(cfg.optim.schedule(cfg.num_steps)(step))}
        self.log.log({**record, **metrics})
        # only a finished step changes the learner: an interrupt before this line leaves the
        # state of the previous step, which is what a checkpoint at `done` must hold
        learner.state = new_state

    def _update(self, learner: _Learner, batch: Batch) -> tuple[TrainState, dict[str, float]]:
        """num_iterations updates on one batch; old log-probs are those before the first."""
        state = learner.state
        if self.config.num_iterations > 1:
            old = learner.logprob_fn(state.trainable, learner.frozen, batch)
            batch = batch.replace(old_logps=old)
        first = None
        for _ in range(self.config.num_iterations):
            state, metrics = learner.step_fn(state, learner.frozen, batch)
            first = first or metrics
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # the gap is measured before any update of this step: the first iteration's
        metrics["sampler_logprob_gap"] = float(first["sampler_logprob_gap"])
        return state, metrics

    # -- set-up and teardown -------------------------------------------------------------------
    @staticmethod
    def _check_data(
        cfg: MMGRPOConfig, trainset: Sequence[Example], valset: Sequence[Example]
    ) -> None:
        if cfg.examples_per_step > len(trainset):
            raise ValueError(
                f"MMGRPOConfig.examples_per_step={cfg.examples_per_step} is larger than the "
                f"trainset ({len(trainset)} examples)"
            )
        for example in [*trainset, *valset]:
            example.inputs()  # every row must name its inputs before any compute

    def _learner(self) -> _Learner:
        cfg = self.config
        optimizer = cfg.optim.build(cfg.num_steps)
        # "full" training has no LoRA-off base to measure KL against: a frozen copy of the start
        frozen_reference = cfg.train == "full" and cfg.loss.beta > 0
        graphdef, state, frozen = split_for_training(
            self.model, optimizer, self.trainable, seed=cfg.seed, frozen_reference=frozen_reference
        )
        step_fn = make_train_step(graphdef, optimizer, cfg.resolved_loss, cfg.sampler.temperature)
        return _Learner(state, frozen, step_fn, make_logprob_fn(graphdef, cfg.sampler.temperature))

    def _open_engine(self, closing: ExitStack) -> RolloutEngine:
        if self.engine is not None:
            return self.engine
        if self._engine_factory is not None:
            engine = self._engine_factory(self.model)
        else:
            engine = default_engine(self.model, self.stop_token_ids, self.config)
        closing.callback(engine.close)
        return engine

    def _lms(self, engine: RolloutEngine) -> tuple[EngineLM, EngineLM]:
        """The rollouts' sampling LM and the evaluation's greedy one, on the same engine."""
        s = self.config.sampler
        sampling = Sampling(s.max_completion_tokens, s.temperature, s.top_p)
        greedy = dataclasses.replace(sampling, temperature=0.0)
        return tuple(
            EngineLM(engine, self.tokenizer, sampling=x, max_prompt_tokens=s.max_prompt_tokens)
            for x in (sampling, greedy)
        )

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
        start = time.perf_counter()
        reward = evaluate(program, valset, self.metric, lm)
        self.log.log(
            {"step": float(step), "eval_reward": reward, "time/eval": time.perf_counter() - start}
        )

    def _resume(
        self, checkpoints: Checkpointer, learner: _Learner, engine: RolloutEngine, program: Module
    ) -> int:
        restored = checkpoints.restore(learner.state, learner.frozen.reference)
        if restored is None:
            return 0
        learner.state = restored.state
        learner.frozen = dataclasses.replace(learner.frozen, reference=restored.reference)
        program.load_state(restored.meta["program"])
        engine.load_state_dict(restored.meta["engine"])
        engine.update_weights(learner.state.trainable)
        return restored.step

    def _save(
        self,
        checkpoints: Checkpointer,
        step: int,
        learner: _Learner,
        engine_state: dict[str, Any],
        program: Module,
    ) -> None:
        meta = {
            "engine": engine_state,
            "program": program.dump_state(),
            "config": dataclasses.asdict(self.config),
        }
        checkpoints.save(step, learner.state, learner.frozen.reference, meta)
