"""mmGRPO's configuration: one frozen dataclass per concern, validated where it is built.

`MMGRPOConfig` holds the run (grouping, rollouts, steps, cadence, paths) and one section per
concern: `loss` (rl.losses.LossConfig), `optim`, `sampler`, `memory`, `parallel`,
`distributed`, `lora`. YAML files and
`key=value` overrides address sections with dotted keys (`sampler.temperature=0.7`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, Literal

import optax
from flax import nnx

import mmgrpo_jax.rl.branch  # noqa: F401 (registers grouping="branch")
from mmgrpo_jax.config_files import setting
from mmgrpo_jax.errors import bad_field as _bad
from mmgrpo_jax.errors import check_field_types
from mmgrpo_jax.parallel import DistributedConfig, ParallelConfig
from mmgrpo_jax.rl.advantages import SCALES
from mmgrpo_jax.rl.grouping import ALIGN_MODES, grouping_rule
from mmgrpo_jax.rl.losses import VARIANTS, LossConfig
from models.attention import IMPLEMENTATIONS, AttentionConfig
from models.config import PRESETS
from models.fetch import MODELS, resolve_model_path
from models.lora import LoRAConfig

ENGINES = ("continuous", "static")
LOSS_UNITS = ("token", "call", "trajectory", "example")  # MMGRPOConfig.loss_unit


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup, an optional decay to zero, and global-norm clipping."""

    lr: float = setting(1e-5, "the peak learning rate, after warmup")
    warmup_steps: int = setting(0, "linear warmup from 0")
    decay: Literal["constant", "linear", "cosine"] = setting(
        "constant", "after warmup, to 0 at the end"
    )
    weight_decay: float = setting(0.0, "AdamW's, decoupled")
    max_grad_norm: float = setting(1.0, "global-norm clipping of the whole step's gradient")
    micro_batch_size: int = setting(
        8, "rows per forward/backward; a step accumulates its micro-batches"
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.lr > 0:
            raise _bad(self, "lr", "must be > 0")
        if self.warmup_steps < 0:
            raise _bad(self, "warmup_steps", "must be >= 0")
        if self.decay not in ("constant", "linear", "cosine"):
            raise _bad(self, "decay", "must be constant, linear or cosine")
        if self.micro_batch_size < 1:
            raise _bad(self, "micro_batch_size", "must be >= 1")
        if not self.max_grad_norm > 0:
            raise _bad(self, "max_grad_norm", "must be > 0")

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
class SamplerConfig:
    """How rollouts sample; the trainer's log-probs use the same temperature."""

    temperature: float = setting(1.0, "above 0 in training (evaluation samples greedily)")
    top_p: float = setting(1.0, "nucleus sampling; 1.0 = the full distribution")
    max_prompt_tokens: int | None = setting(
        None, "longer prompts are refused; null: the model's limit"
    )
    max_completion_tokens: int = setting(256, "new tokens per LM call at most")
    batch: int = setting(64, "most requests in one sampler call")
    max_cache_tokens: int | None = setting(
        None,
        (
            "most padded rows x cache slots (prompt + new tokens, bucketed) one sampler "
            "call may hold: a larger batch is sampled in several calls; null = no bound "
            "(`mmgrpo plan` sizes it)"
        ),
    )
    max_wait_s: float = setting(
        0.05, "a batch closes early once its oldest request waited this long"
    )
    engine: Literal["continuous", "static"] = setting(
        "continuous",
        (
            "continuous: `batch` slots that requests join and leave between decode calls of"
            " `decode_steps` tokens (engines.continuous); static: batches decoded to their "
            "longest row"
        ),
    )
    decode_steps: int = setting(8, "continuous: tokens per decode call between admissions")
    prefix_sharing: bool = setting(True, "continuous: prefill a prefix a slot holds once, copy it")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.engine not in ENGINES:
            raise _bad(self, "engine", f"must be one of {ENGINES}")
        if self.decode_steps < 1:
            raise _bad(self, "decode_steps", "must be >= 1")
        if not self.temperature > 0:
            raise _bad(self, "temperature", "must be > 0 (sampling and training share it)")
        if not 0 < self.top_p <= 1:
            raise _bad(self, "top_p", "must be in (0, 1]")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise _bad(self, "max_prompt_tokens", "must be >= 1 or null")
        if self.max_completion_tokens < 1:
            raise _bad(self, "max_completion_tokens", "must be >= 1")
        if self.batch < 1:
            raise _bad(self, "batch", "must be >= 1")
        if self.max_cache_tokens is not None and self.max_cache_tokens < 1:
            raise _bad(self, "max_cache_tokens", "must be >= 1 or null")
        if not self.max_wait_s > 0:
            raise _bad(self, "max_wait_s", "must be > 0")


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """What the policy recomputes instead of keeping (docs/design.md#scale). The defaults are the
    reference paths, right for tiny models; an 8B policy at 8k context needs blockwise
    attention, remat and the two chunks (`mmgrpo plan` shows each one's effect)."""

    attention: Literal["dense", "blockwise", "pallas"] = setting(
        "dense",
        (
            "dense: the reference; blockwise: online-softmax tiles with their own backward "
            "pass; pallas: the fused kernel for passes without a cache (GPU), blockwise for"
            " the sampler"
        ),
    )
    attention_block: int = setting(512, "query and key positions per attention tile")
    remat: bool = setting(
        False, "recompute every block in the backward pass (keep block inputs only)"
    )
    logits_chunk: int = setting(
        0, "positions per lm_head chunk in log-prob passes; 0 = all at once"
    )
    prefill_chunk: int = setting(0, "prompt tokens per sampler prefill pass; 0 = the whole prompt")
    pack: bool = setting(
        True,
        (
            "training rows packed end to end into sequences (no row padded to the longest):"
            " each micro-batch holds no more token slots than optim.micro_batch_size padded"
            " rows would, in sequences sized from the step's rows; false: rows padded (the "
            "reference)"
        ),
    )
    pack_length: int = setting(
        0, ("the longest a packed sequence may be, in tokens; 0: chosen from the step's rows")
    )
    share_prompts: bool = setting(
        True,
        (
            "with pack: every packed sequence is a prefix tree of its rows, so a prefix "
            "that rows share (a group's G calls of a module on one input, the instruction "
            "across inputs, replies that agree) is computed once in the forward and "
            "backward, exactly; false: rows packed apart"
        ),
    )
    check_fit: bool = setting(
        True,
        (
            "`mmgrpo train` compiles the step and the sampler abstractly before reading "
            "weights and refuses a run that cannot fit; false skips that (a run that does "
            "not fit then fails at its first out-of-memory error)"
        ),
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.attention not in IMPLEMENTATIONS:
            raise _bad(self, "attention", f"must be one of {IMPLEMENTATIONS}")
        if self.attention_block < 1:
            raise _bad(self, "attention_block", "must be >= 1")
        for name in ("logits_chunk", "prefill_chunk"):
            if getattr(self, name) < 0:
                raise _bad(self, name, "must be >= 0 (0 = no chunking)")
        if self.pack_length < 0:
            raise _bad(self, "pack_length", "must be >= 0 (0 = chosen from the step's rows)")
        if self.pack_length and not self.pack:
            raise _bad(self, "pack_length", "caps packed sequences: it needs pack true")
        if self.share_prompts and not self.pack:
            raise _bad(
                self,
                "share_prompts",
                "needs packed rows: with pack false (rows padded) set share_prompts false too",
            )
        if self.share_prompts and self.attention == "pallas":
            raise _bad(
                self,
                "share_prompts",
                "needs attention 'dense' or 'blockwise' (the Pallas kernel takes segment ids "
                "only, not a prefix tree); set share_prompts false to pack rows apart",
            )

    @property
    def attention_config(self) -> AttentionConfig:
        block = self.attention_block
        return AttentionConfig(self.attention, q_block=block, kv_block=block)


@dataclasses.dataclass(frozen=True)
class MMGRPOConfig:
    grouping: str = setting(
        "module", 'a registered grouping rule: "module", "trajectory", or yours'
    )
    align: str = setting(
        "truncate",
        (
            "module-level groups when rollouts call a module unequally: truncate | "
            "fill_random | fill_last | ragged (docs: grouping)"
        ),
    )
    num_rollouts: int = setting(8, "G: rollouts per example, and every group's size")
    select_k: int | None = setting(None, "keep K members spread over the rewards instead of G")
    branch_module: str | None = setting(
        None,
        (
            "grouping=branch: the predictor (named as named_predictors() names it) whose "
            "call the G rollouts of an example branch at, sharing every call before it, and"
            " which of its calls"
        ),
    )
    branch_invocation: int = 0
    examples_per_step: int = 4
    num_steps: int = 100
    num_iterations: int = setting(1, "updates per batch of rollouts (> 1: the ratios move)")
    advantage_scale: str = setting(
        "group",
        ("std per group | over the whole step (batch) | none, or a registered advantage scale"),
    )
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    loss_unit: str | None = setting(
        None,
        (
            "what gets equal weight in the loss: token | call | trajectory | example; null:"
            " the loss variant's aggregation over the grouping rule's unit (module: call, "
            "trajectory: trajectory)"
        ),
    )
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    mask_truncated_completions: bool = setting(
        False, "a reply cut at the token limit trains nothing"
    )
    failure_score: float = setting(0.0, "the reward of a rollout whose program or metric raised")
    format_failure_score: float = setting(
        -1.0, "the reward of a rollout with a reply that did not parse"
    )
    eval_every: int = setting(10, "steps between greedy evaluations on the valset")
    samples_per_step: int = setting(
        2,
        (
            "examples a step whose calls (prompt, reply, reward, group, advantage) go to "
            "samples.jsonl, all their rollouts; 0: none, -1: every example (TRL's "
            "num_completions_to_print)"
        ),
    )
    checkpoint_every: int = setting(10, "steps between checkpoints (and one on a stop signal)")
    max_skipped_updates: int = setting(
        3,
        (
            "the run stops after this many updates in a row with a non-finite loss / "
            "gradient (skipped)"
        ),
    )
    failing_error_fraction: float = setting(
        1.0,
        (
            "a step where at least this fraction of rollouts raised (program or metric) "
            "counts as failed; max_failed_steps failed steps in a row stop the run with the"
            " first error"
        ),
    )
    max_failed_steps: int = 3
    seed: int = setting(0, "the data order, the adapter's init and every sample")
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    train: Literal["lora", "full"] = setting(
        "lora", "full: every weight (tiny from-scratch policies)"
    )
    model_path: str | None = setting(
        None,
        (
            "a local HF checkpoint folder, a GGUF, or a fetched registry model's name "
            "(smollm2-135m), when no model is passed in"
        ),
    )
    model_shape: str | None = setting(
        None, "a preset shape (qwen3-8b, ...): `mmgrpo plan` without it"
    )
    dtype: Literal["bfloat16", "float32"] = setting(
        "bfloat16", "of the weights read from model_path"
    )
    run_dir: str = setting("runs/mmgrpo", "metrics, checkpoints, the adapter; one run at a time")
    resume: bool = setting(False, "continue from run_dir's last intact checkpoint")
    progress: bool = setting(True, "a progress bar on stderr")

    def __post_init__(self) -> None:
        check_field_types(self)
        grouping_rule(self.grouping, "MMGRPOConfig.grouping")  # a miss lists the registered rules
        if self.align not in ALIGN_MODES:
            raise _bad(self, "align", f"must be one of {ALIGN_MODES}")
        if self.num_rollouts < 2:
            raise _bad(self, "num_rollouts", "must be >= 2 (a group of one has no advantage)")
        if self.select_k is not None and self.select_k < 2:
            raise _bad(self, "select_k", "must be >= 2 or null")
        if (self.grouping == "branch") != (self.branch_module is not None):
            raise _bad(self, "branch_module", "names the branch call, with grouping=branch only")
        if self.branch_invocation < 0:
            raise _bad(self, "branch_invocation", "must be >= 0")
        at_least_one = (
            "examples_per_step",
            "num_steps",
            "num_iterations",
            "eval_every",
            "checkpoint_every",
            "max_skipped_updates",
            "max_failed_steps",
        )
        for field in at_least_one:
            if getattr(self, field) < 1:
                raise _bad(self, field, "must be >= 1")
        if self.samples_per_step < -1:
            raise _bad(self, "samples_per_step", "must be >= 0, or -1 for every example")
        if not 0 < self.failing_error_fraction <= 1:
            raise _bad(self, "failing_error_fraction", "must be in (0, 1]")
        if not 0 <= self.seed < 2**32:
            raise _bad(self, "seed", "must be in [0, 2**32) (it seeds the sampling keys)")
        if self.advantage_scale not in SCALES:
            raise _bad(
                self,
                "advantage_scale",
                f"must be a registered advantage scale ({sorted(SCALES)}; add one with "
                f"{SCALES.register_with})",
            )
        self._check_loss_unit()
        if self.train not in ("lora", "full"):
            raise _bad(self, "train", "must be 'lora' or 'full'")
        if self.dtype not in ("bfloat16", "float32"):
            raise _bad(self, "dtype", "must be 'bfloat16' or 'float32'")
        if self.model_shape is not None and self.model_shape not in PRESETS:
            raise _bad(self, "model_shape", f"must be a preset: one of {sorted(PRESETS)}")
        if self.model_path is not None and not resolve_model_path(self.model_path).exists():
            raise _bad(
                self,
                "model_path",
                "is neither a checkpoint folder, a GGUF file nor a fetched registry model "
                f"({sorted(MODELS)})",
            )
        pack, prompt = self.memory.pack_length, self.sampler.max_prompt_tokens
        completion = self.sampler.max_completion_tokens
        if pack and prompt is None:  # a prompt up to the model's limit: no pack would hold it
            raise ValueError(
                f"MMGRPOConfig.memory.pack_length={pack} needs a bound on the rows it packs: set "
                f"sampler.max_prompt_tokens (at most pack_length - max_completion_tokens = "
                f"{pack - completion}); it is null, so a prompt could be as long as the model "
                "allows"
            )
        longest = None if prompt is None else prompt + completion
        if pack and longest is not None and pack < longest:
            raise ValueError(
                f"MMGRPOConfig.memory.pack_length={pack} is shorter than the longest row, "
                f"sampler.max_prompt_tokens + max_completion_tokens = {longest}"
            )
        if self.memory.share_prompts and self.lora.dropout > 0:
            raise ValueError(
                f"MMGRPOConfig.memory.share_prompts with lora.dropout={self.lora.dropout}: a "
                "shared prefix runs once, so its rows would share one dropout draw; set "
                "memory.share_prompts false (rows packed apart) or lora.dropout 0"
            )
        if self.lora.modules and self.train != "lora":
            raise ValueError(
                f"MMGRPOConfig.lora.modules={list(self.lora.modules)} needs train='lora', got "
                f"{self.train!r}"
            )
        shards = self.parallel.row_shards
        if shards is not None and self.optim.micro_batch_size % shards:
            raise ValueError(
                f"MMGRPOConfig.optim.micro_batch_size={self.optim.micro_batch_size} does not split "
                f"over parallel.data x fsdp = {shards} devices; make it a multiple of {shards}"
            )
        length = self.loss.max_completion_length
        if length is not None and length != self.sampler.max_completion_tokens:
            raise ValueError(
                f"MMGRPOConfig.loss.max_completion_length={length} differs from "
                f"sampler.max_completion_tokens={self.sampler.max_completion_tokens}; leave it "
                "unset (it follows the sampler) or make them equal"
            )

    @property
    def per_module_adapters(self) -> bool:
        """Whether modules train adapters of their own (several, `lora.modules`)."""
        return self.train == "lora" and self.lora.num_adapters > 1

    @property
    def trainable(self) -> Any:
        """The NNX filter of what training changes (and what the engine receives)."""
        return nnx.LoRAParam if self.train == "lora" else nnx.Param

    @property
    def resolved_loss(self) -> LossConfig:
        """The loss the trainer runs: dr_grpo's constant normaliser, unless given (and then equal),
        is the longest completion the sampler may return; `loss_unit` sets the aggregation."""
        limit = self.sampler.max_completion_tokens
        loss = dataclasses.replace(self.loss, max_completion_length=limit)
        if self.loss_unit is not None:
            unit_aggregation = "token_mean_global" if self.loss_unit == "token" else "sequence_mean"
            loss = dataclasses.replace(loss, aggregation=unit_aggregation)
        return loss

    @property
    def row_unit(self) -> str:
        """What a training row's unit id groups (rl.batch.rows_from_groups' `unit`)."""
        if self.loss_unit is None:
            return grouping_rule(self.grouping).unit
        return {"token": "row", "call": "row", "trajectory": "rollout", "example": "example"}[
            self.loss_unit
        ]

    def _check_loss_unit(self) -> None:
        """loss_unit replaces the variant's aggregation: only where that means "equal weight per
        unit" (a sequence mean or a token mean), never silently for dr_grpo, bnpo or luspo."""
        if self.loss_unit is None:
            return
        if self.loss_unit not in LOSS_UNITS:
            raise _bad(self, "loss_unit", f"must be one of {LOSS_UNITS} or null")
        own = VARIANTS[self.loss.variant].aggregation
        if self.loss.aggregation is not None or own not in ("sequence_mean", "token_mean_global"):
            raise ValueError(
                f"MMGRPOConfig.loss_unit={self.loss_unit!r} sets the loss's aggregation; "
                f"loss.variant={self.loss.variant!r} aggregates by "
                f"{self.loss.aggregation or own!r}: leave loss_unit null, or use a variant "
                "whose aggregation is a sequence or token mean (grpo, dapo, cispo, gspo, sapo, "
                "vespo)"
            )


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted `key: value` pairs (for diffs a user can read)."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def field_defaults(cls: type) -> dict[str, Any]:
    """A config class's field defaults, flattened like `flatten` (JSON values), without building
    the class itself (a top-level config may refuse its own defaults, e.g. a missing path)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        elif field.default is not dataclasses.MISSING:
            value = field.default
        else:
            continue
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        out[field.name] = json.loads(json.dumps(value))
    return flatten(out)


def changed_keys(
    old: dict[str, Any], new: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """The keys whose values differ between two flattened configs (NaN equals NaN). With
    `defaults` (`field_defaults`), a key the old record lacks is no change if the new value is
    the field's default: a field added since the record was written, keeping the old behaviour."""

    def same(a: Any, b: Any) -> bool:
        both_nan = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
        return both_nan or a == b

    def added_as_default(k: str) -> bool:
        if defaults is None or k in old or k not in new or k not in defaults:
            return False
        return same(defaults[k], new[k])

    keys = set(old) | set(new)
    return sorted(k for k in keys if not same(old.get(k), new.get(k)) and not added_as_default(k))


def computes_the_same(key: str, old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether a dotted config key, changed between two flat settings, says only how a run is
    computed, not what: the memory layout (remat, chunks, packing, shared prefixes), the device
    mesh, and the micro-batch size (the loss carries the step's normalisers, so accumulated
    micro-batches give the step's loss: tests/rl/test_step.py) unless the loss is bnpo (a mean
    of micro-batch token means by definition) or LoRA dropout draws per micro-batch. Runs that
    differ only in these are the same run, up to floating-point summation order."""
    if key.split(".")[-2:-1] in (["memory"], ["parallel"]):
        return True
    suffix = "optim.micro_batch_size"
    if key == suffix or key.endswith("." + suffix):
        prefix = key[: -len(suffix)]
        return all(
            s.get(f"{prefix}loss.variant") not in (None, "bnpo")
            and s.get(f"{prefix}lora.dropout", 0.0) == 0.0
            for s in (old, new)
        )
    return False


def describe_changes(old: dict[str, Any], new: dict[str, Any], keys: Sequence[str]) -> str:
    """`key: old -> new, ...` for the given keys (the diff a refusal names)."""
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
