"""The mmGRPO optimizer: rollouts -> rewards -> groups -> advantages -> update, step after step.

`MMGRPO(metric, config).compile(program, trainset, valset)` trains the policy behind every
predictor of `program` (one shared LoRA adapter) and returns the program; the policy is loaded
from `config.model_path` or passed in (`model=`, `tokenizer=`, `stop_token_ids=`). The loop is
thin; each stage is its own function; all state that a resumed run needs (trainable parameters,
optimizer state, step, sampler RNG counter, prompt state) goes into an orbax checkpoint, and the
data order is a pure function of (seed, step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from tqdm.auto import tqdm

from mmgrpo_jax.rl.advantages import SCALES, advantages_for_groups
from mmgrpo_jax.rl.grouping import ALIGN_MODES, Group, module_level_groups, trajectory_level_groups
from mmgrpo_jax.engines.jax_engine import JaxLM, Sampling
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.rl.rollout import Metric, Trajectory, run_rollouts, score_examples, summarize
from mmgrpo_jax.trainer.run_log import RunLogger
from mmgrpo_jax.rl.step import (
    Batch,
    Row,
    TrainState,
    make_logprob_fn,
    make_train_step,
    micro_batch_layout,
    pack_rows,
    rows_from_groups,
    split_for_training,
)
from models.decoder import Decoder
from models.export import save_peft_adapter
from models.hf import load_checkpoint
from models.lora import LoRAConfig
from models.tokenizer import HFTokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup, an optional decay to zero, and global-norm clipping."""

    lr: float = 1e-5
    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimConfig.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in ("constant", "linear", "cosine"):
            raise ValueError(
                f"OptimConfig.decay must be constant, linear or cosine, got {self.decay!r}"
            )
        if self.micro_batch_size < 1:
            raise ValueError(
                f"OptimConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}"
            )
        if not self.max_grad_norm > 0:
            raise ValueError(f"OptimConfig.max_grad_norm must be > 0, got {self.max_grad_norm}")

    def schedule(self, num_steps: int) -> optax.Schedule:
        after = max(num_steps - self.warmup_steps, 1)
        end = 0.0 if self.decay != "constant" else self.lr
        if self.decay == "cosine":
            main = optax.cosine_decay_schedule(self.lr, after)
        else:
            main = optax.linear_schedule(self.lr, end, after)
        if self.warmup_steps == 0:
            return main
        warmup = optax.linear_schedule(0.0, self.lr, self.warmup_steps)
        return optax.join_schedules([warmup, main], [self.warmup_steps])

    def build(self, num_steps: int) -> optax.GradientTransformation:
        return optax.chain(
            optax.clip_by_global_norm(self.max_grad_norm),
            optax.adamw(self.schedule(num_steps), weight_decay=self.weight_decay),
        )


@dataclasses.dataclass(frozen=True)
class MMGRPOConfig:
    grouping: Literal["module", "trajectory"] = "module"
    align: str = "truncate"
    num_rollouts: int = 8
    select_k: int | None = None
    examples_per_step: int = 4
    num_steps: int = 100
    num_iterations: int = 1
    advantage_scale: str = "group"
    loss: LossConfig = dataclasses.field(default_factory=lambda: LossConfig("grpo"))
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    temperature: float = 1.0
    top_p: float = 1.0
    max_prompt_tokens: int | None = None
    max_completion_tokens: int = 256
    mask_truncated_completions: bool = False
    failure_score: float = 0.0
    format_failure_score: float = -1.0
    eval_every: int = 10
    checkpoint_every: int = 10
    seed: int = 0
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    train: Literal["lora", "full"] = "lora"
    model_path: str | None = None  # a local HF checkpoint, when no model is passed in
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    run_dir: str = "runs/mmgrpo"
    resume: bool = False
    sampler_batch: int = 64
    sampler_max_wait_s: float = 0.05
    progress: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"MMGRPOConfig.{field} {rule}, got {getattr(self, field)!r}")

        if self.grouping not in ("module", "trajectory"):
            raise bad("grouping", "must be 'module' or 'trajectory'")
        if self.align not in ALIGN_MODES:
            raise bad("align", f"must be one of {ALIGN_MODES}")
        if self.num_rollouts < 2:
            raise bad("num_rollouts", "must be >= 2 (a group of one has no advantage)")
        if self.select_k is not None and self.select_k < 2:
            raise bad("select_k", "must be >= 2 or null")
        for field in ("examples_per_step", "num_steps", "num_iterations", "eval_every"):
            if getattr(self, field) < 1:
                raise bad(field, "must be >= 1")
        if self.checkpoint_every < 1:
            raise bad("checkpoint_every", "must be >= 1")
        if self.advantage_scale not in SCALES:
            raise bad("advantage_scale", f"must be one of {SCALES}")
        if not self.temperature > 0:
            raise bad("temperature", "must be > 0 (sampling and training share it)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.max_completion_tokens < 1:
            raise bad("max_completion_tokens", "must be >= 1")
        if self.train not in ("lora", "full"):
            raise bad("train", "must be 'lora' or 'full'")
        if self.dtype not in ("bfloat16", "float32"):
            raise bad("dtype", "must be 'bfloat16' or 'float32'")
        if self.model_path is not None and not Path(self.model_path).is_dir():
            raise bad("model_path", "is not a directory (a local Hugging Face checkpoint)")


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


def group_trajectories(
    config: MMGRPOConfig, trajectories: list[Trajectory], step: int
) -> list[Group]:
    if config.grouping == "trajectory":
        return trajectory_level_groups(trajectories, select_k=config.select_k)
    return module_level_groups(
        trajectories, align=config.align, select_k=config.select_k, seed=config.seed + step
    )


def group_metrics(groups: Sequence[Group], advantages: Sequence[np.ndarray]) -> dict[str, float]:
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
    metrics: dict[str, float] = {"groups": float(len(groups))}
    for name, count in per_module.items():
        metrics[f"groups/{name}"] = float(count)
        metrics[f"zero_variance_fraction/{name}"] = flat[name] / count
    for name, values in lengths.items():
        metrics[f"completion_length/{name}"] = float(np.mean(values))
    return metrics


def evaluate(program: Module, examples: Sequence[Example], metric: Metric, lm: JaxLM) -> float:
    """Mean greedy reward; failures score 0 here so that a broken format is not rewarded."""
    if not examples:
        return float("nan")
    return float(np.mean([t.reward for t in score_examples(program, examples, metric, lm=lm)]))


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
    ) -> None:
        """The policy is `model` + `tokenizer` + `stop_token_ids`, or else `config.model_path`."""
        if model is None:
            model, tokenizer, stop_token_ids = load_policy(config)
        elif tokenizer is None or stop_token_ids is None:
            raise ValueError("a model passed in needs its tokenizer and stop_token_ids too")
        if config.train == "lora" and model.lora is None:
            raise ValueError("train='lora' needs a model built with a LoRA adapter (lora=...)")
        self.metric, self.config, self.model, self.tokenizer = metric, config, model, tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.run_dir = Path(config.run_dir)
        self.log: RunLogger | None = None
        self.summary: dict[str, Any] | None = None  # summary.json's content, after compile

    # -- the public entry point -------------------------------------------------------------
    def compile(
        self, program: Module, trainset: Sequence[Example], valset: Sequence[Example] = ()
    ) -> Module:
        cfg = self.config
        if cfg.examples_per_step > len(trainset):
            raise ValueError(
                f"MMGRPOConfig.examples_per_step={cfg.examples_per_step} is larger than the "
                f"trainset ({len(trainset)} examples)"
            )
        for example in [*trainset, *valset]:
            example.inputs()  # every row must name its inputs before any compute
        saved = self.run_dir / "checkpoints"
        if not cfg.resume and saved.is_dir() and any(saved.iterdir()):
            # orbax would skip saving steps that exist: the new run's checkpoints would be lost
            raise ValueError(
                f"MMGRPOConfig.run_dir={str(self.run_dir)!r} already holds checkpoints of another "
                "run: set resume=true to continue it, or choose another run_dir"
            )
        self.log = RunLogger(self.run_dir)
        optimizer = cfg.optim.build(cfg.num_steps)
        trainable = nnx.LoRAParam if cfg.train == "lora" else nnx.Param
        graphdef, state, frozen = split_for_training(self.model, optimizer, trainable)
        step_fn = make_train_step(
            graphdef, optimizer, cfg.loss, cfg.temperature, cfg.grouping == "trajectory"
        )
        logprob_fn = make_logprob_fn(graphdef, cfg.temperature)
        # "full" training has no LoRA-off base to measure KL against: a frozen copy of the start
        reference = None
        if cfg.train == "full" and cfg.loss.beta > 0:
            reference = jax.tree.map(jnp.copy, state.trainable)
        sampling = Sampling(cfg.max_completion_tokens, cfg.temperature, cfg.top_p)
        lm = self._lm(sampling, cfg.seed)
        greedy = self._lm(dataclasses.replace(sampling, temperature=0.0), cfg.seed)
        manager = ocp.CheckpointManager(
            (self.run_dir / "checkpoints").absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        )
        start = 0
        if cfg.resume and manager.latest_step() is not None:
            state, reference, start = self._restore(manager, state, reference, program, lm)
            nnx.update(self.model, state.trainable)
        schedule = cfg.optim.schedule(cfg.num_steps)
        bar = tqdm(
            range(start, cfg.num_steps),
            desc="mmGRPO",
            disable=not cfg.progress,
            initial=start,
            total=cfg.num_steps,
        )
        # What a checkpoint must hold is the state after the last *completed* step, including the
        # sampler's call counter then (an interrupted step has already drawn from it).
        done, calls_done = start, lm.calls
        try:
            for step in bar:
                if step % cfg.eval_every == 0 and valset:
                    # logged at x = completed updates, so the curve starts at the untrained policy
                    evaluation: dict[str, float] = {"step": float(step)}
                    evaluation["eval_reward"] = self._timed(
                        evaluation, "eval", evaluate, program, valset, self.metric, greedy
                    )
                    self.log.log(evaluation)
                record: dict[str, float] = {"step": float(step + 1), "lr": float(schedule(step))}
                state, metrics = self._step(
                    program,
                    trainset,
                    lm,
                    (state, frozen, reference),
                    step_fn,
                    logprob_fn,
                    step,
                    record,
                )
                done, calls_done = step + 1, lm.calls
                record.update(metrics)
                self.log.log(record)
                bar.set_postfix(reward=f"{record['reward_mean']:.3f}")
                if done % cfg.checkpoint_every == 0:
                    self._save(manager, done, (state, reference), program, calls_done)
            if valset:
                final = {
                    "step": float(done),
                    "eval_reward": evaluate(program, valset, self.metric, greedy),
                }
                self.log.log(final)
            self._save(manager, done, (state, reference), program, calls_done)
        except KeyboardInterrupt:
            logger.warning("interrupted: writing a checkpoint at step %d before exiting", done)
            self._save(manager, done, (state, reference), program, calls_done)
            raise
        finally:
            manager.wait_until_finished()
            lm.close()
            greedy.close()
        if cfg.train == "lora":
            save_peft_adapter(self.model, self.run_dir / "adapter")
        self.summary = self.log.close({"steps": cfg.num_steps, "grouping": cfg.grouping})
        return program

    # -- weights, for BetterTogether ---------------------------------------------------------
    def snapshot_weights(self) -> nnx.State:
        """A host copy of the trainable parameters (LoRA, or all in "full" mode)."""
        kind = nnx.LoRAParam if self.config.train == "lora" else nnx.Param
        return jax.tree.map(np.array, nnx.state(self.model, kind))

    def restore_weights(self, snapshot: nnx.State) -> None:
        nnx.update(self.model, jax.tree.map(jnp.asarray, snapshot))

    # -- one step ------------------------------------------------------------------------------
    def _step(self, program, trainset, lm, weights, step_fn, logprob_fn, step, record):
        cfg = self.config
        state, frozen, reference = weights
        chosen = [
            trainset[i]
            for i in examples_for_step(len(trainset), cfg.examples_per_step, step, cfg.seed)
        ]
        trajectories = self._timed(
            record,
            "rollout",
            run_rollouts,
            program,
            chosen,
            self.metric,
            num_rollouts=cfg.num_rollouts,
            lm=lm,
            failure_score=cfg.failure_score,
            format_failure_score=cfg.format_failure_score,
        )
        rewards = np.array([t.reward for t in trajectories])
        metrics: dict[str, float] = {k: float(v) for k, v in summarize(trajectories).items()}
        metrics["reward_std"] = float(rewards.std())
        sampled = sum(len(c.completion_ids or ()) for t in trajectories for c in t.calls)
        metrics["rollout_tokens_per_s"] = sampled / max(record["time/rollout"], 1e-9)
        groups = group_trajectories(cfg, trajectories, step)
        advantages = advantages_for_groups(groups, cfg.advantage_scale)
        metrics.update(group_metrics(groups, advantages))
        rows = rows_from_groups(
            groups,
            advantages,
            trajectory_level=cfg.grouping == "trajectory",
            mask_truncated_completions=cfg.mask_truncated_completions,
        )
        if not rows:
            logger.warning("step %d produced no training rows; skipping the update", step + 1)
            return state, metrics
        start = time.perf_counter()
        trajectory_level = cfg.grouping == "trajectory"
        batch = pack_rows(rows, cfg.optim.micro_batch_size, trajectory_level=trajectory_level)
        layout = micro_batch_layout(rows, cfg.optim.micro_batch_size, trajectory_level)
        old = logprob_fn(state.trainable, frozen, batch)
        metrics["sampler_logprob_gap"] = sampler_gap(rows, old, batch, layout)
        if cfg.num_iterations > 1:
            batch = batch.replace(old_logps=old)
        for _ in range(cfg.num_iterations):
            state, step_metrics = step_fn(state, frozen, batch, reference)
        nnx.update(self.model, state.trainable)  # the sampler's next rollouts use the update
        step_metrics = jax.device_get(step_metrics)
        train_seconds = time.perf_counter() - start
        metrics.update({k: float(v) for k, v in step_metrics.items()})
        metrics["time/train"] = train_seconds
        metrics["train_tokens_per_s"] = float(step_metrics["tokens"]) / max(train_seconds, 1e-9)
        metrics["sampler_occupancy"] = lm.stats.occupancy
        return state, metrics

    # -- helpers -------------------------------------------------------------------------------
    def _lm(self, sampling: Sampling, seed: int) -> JaxLM:
        cfg = self.config
        return JaxLM(
            self.model,
            self.tokenizer,
            sampling=sampling,
            stop_token_ids=self.stop_token_ids,
            max_prompt_tokens=cfg.max_prompt_tokens,
            max_batch=cfg.sampler_batch,
            max_wait_s=cfg.sampler_max_wait_s,
            seed=seed,
        )

    @staticmethod
    def _timed(record: dict[str, float], name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        record[f"time/{name}"] = time.perf_counter() - start
        return result

    def _save(self, manager, step: int, weights, program: Module, sampler_calls: int) -> None:
        if step in manager.all_steps():
            return  # the periodic save of this step already holds exactly this state
        meta = {
            "step": step,
            "sampler_calls": sampler_calls,
            "program": program.dump_state(),
            "config": dataclasses.asdict(self.config),
        }
        state, reference = weights
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if reference is not None:
            items["reference"] = ocp.args.StandardSave(reference)
        manager.save(step, args=ocp.args.Composite(**items), force=True)

    def _restore(self, manager, state: TrainState, reference, program: Module, lm: JaxLM):
        step = manager.latest_step()

        def abstract(tree):
            return ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))

        items = {"state": abstract(state), "meta": ocp.args.JsonRestore()}
        if reference is not None:
            items["reference"] = abstract(reference)
        restored = manager.restore(step, args=ocp.args.Composite(**items))
        program.load_state(restored.meta["program"])
        lm.calls = restored.meta["sampler_calls"]
        logger.info("resumed from step %d in %s", step, self.run_dir)
        reference = restored.reference if reference is not None else None
        return restored.state, reference, int(restored.meta["step"])


def sampler_gap(
    rows: Sequence[Row], trainer_logps: jax.Array, batch: Batch, layout: list[list[int]]
) -> float:
    """Mean |sampler - trainer| log-prob over completion tokens: a health check of the pipeline."""
    trainer, mask = np.asarray(trainer_logps), np.asarray(batch.loss_mask)
    gaps = []
    for m, chunk in enumerate(layout):
        for i, k in enumerate(chunk):
            row = rows[k]
            if row.sampler_logprobs is None or not row.in_loss:
                continue
            gaps.append(np.abs(trainer[m, i][mask[m, i]] - np.asarray(row.sampler_logprobs)).mean())
    return float(np.mean(gaps)) if gaps else math.nan
