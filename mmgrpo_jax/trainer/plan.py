"""A memory plan before compute: compile the run's train step and sampler on abstract inputs.

Nothing is allocated: the model is built with `nnx.eval_shape`, the inputs are
`jax.ShapeDtypeStruct`s at the config's real shapes (a micro-batch of the longest rows the sampler
can produce; a full sampler batch of the longest prompts), and XLA's own buffer assignment
(`compiled.memory_analysis()`) says what each program needs. `mmgrpo plan` prints it; `mmgrpo
train` runs it before reading weights and refuses a run that cannot fit (docs/design.md#scale).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.rl.batch import Batch, PackShape, row_length_bucket
from mmgrpo_jax.rl.step import FrozenWeights, TrainState, make_train_step
from mmgrpo_jax.sampler.generate import decode_steps, request_slots, rows_within_budget
from mmgrpo_jax.sampler.shapes import row_bucket, token_bucket
from mmgrpo_jax.sampler.slot_pool import RowSampling, decode_pass, extend_pass
from mmgrpo_jax.sampler.token_sampling import RowFilters
from mmgrpo_jax.trainer.config import MMGRPOConfig
from models.config import ModelConfig
from models.decoder import Decoder

logger = logging.getLogger(__name__)
GB = 10**9  # decimal, as device memory is sold (an H200: 141 GB)
# XLA's GPU client takes this fraction of device memory by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
DEFAULT_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of each part of a run, and whether the larger phase fits."""

    model: str
    weights_bytes: int  # every parameter of the policy, as stored
    state_bytes: int  # trainable copy, optimizer state and (full training + KL) the reference
    train_temp_bytes: int  # the train step's temporaries (activations, gradients, logits)
    train_step_bytes: int  # the train step's whole footprint: its arguments, outputs, temps
    kv_cache_bytes: int
    sampler_temp_bytes: int  # the larger of prefill's and decode's temporaries
    sampler_bytes: int  # sampler's footprint (weights, cache, temps) + the trainer's state
    device_bytes: int
    usable_bytes: int  # what the runtime lets a process take (the memory fraction)
    shapes: dict[str, Any]  # the shapes that were compiled, for the reader

    @property
    def peak_bytes(self) -> int:
        return max(self.train_step_bytes, self.sampler_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "peak_bytes": self.peak_bytes,
            "fits": self.fits,
        }

    def table(self) -> str:
        rows = [
            ("weights", self.weights_bytes),
            ("trainable + optimizer state", self.state_bytes),
            ("train-step temporaries", self.train_temp_bytes),
            ("train step, all", self.train_step_bytes),
            ("KV cache", self.kv_cache_bytes),
            ("sampler temporaries", self.sampler_temp_bytes),
            ("sampler, all (+ trainer state)", self.sampler_bytes),
            ("peak", self.peak_bytes),
            ("usable device memory", self.usable_bytes),
            ("device memory", self.device_bytes),
        ]
        lines = [f"memory plan per device: {self.model}"]
        lines += [f"  {k}: {v}" for k, v in self.shapes.items()]
        lines += ["", "| component | GB |", "| --- | ---: |"]
        lines += [f"| {name} | {value / GB:.2f} |" for name, value in rows]
        lines.append(f"| fits | {'yes' if self.fits else 'no'} |")
        return "\n".join(lines)

    def refusal(self, config: MMGRPOConfig) -> str | None:
        """Why the run cannot fit, naming the larger phase and the settings that shrink it."""
        if self.fits:
            return None
        usable = f"{self.usable_bytes / GB:.1f} GB usable of {self.device_bytes / GB:.1f}"
        if self.train_step_bytes >= self.sampler_bytes:
            m = config.memory
            advice = [
                *(["memory.remat=true"] if not m.remat else []),
                *(["memory.attention=blockwise"] if m.attention == "dense" else []),
                *(["memory.logits_chunk=512"] if m.logits_chunk == 0 else []),
                f"a smaller optim.micro_batch_size (now {config.optim.micro_batch_size})",
            ]
            what = f"the train step needs {self.train_step_bytes / GB:.1f} GB"
        else:
            advice = [
                f"a smaller sampler.batch (now {config.sampler.batch}) or a bound on the rows "
                "x slots of one sampler call (sampler.max_cache_tokens)",
                *(["memory.attention=blockwise"] if config.memory.attention == "dense" else []),
                "a shorter sampler.max_prompt_tokens / max_completion_tokens",
            ]
            what = (
                f"the sampler needs {self.sampler_bytes / GB:.1f} GB (KV cache "
                f"{self.kv_cache_bytes / GB:.1f})"
            )
        return f"{self.model}: {what}, {usable}; try {', '.join(advice)} (see `mmgrpo plan`)"


def usable_fraction(platform: str) -> float:
    """The share of a device's memory a process may take: XLA's GPU client preallocates
    XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.75) of it; a CPU process may take it all."""
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if raw:
        return float(raw)
    return 1.0 if platform == "cpu" else DEFAULT_MEMORY_FRACTION


def check_fits(config: MMGRPOConfig) -> MemoryPlan | None:
    """`mmgrpo train`'s check before reading weights: refuse, naming what to change, a run
    whose train step or sampler cannot fit this machine's first device."""
    if not config.memory.check_fit or config.model_path is None:
        return None
    if config.sampler.max_prompt_tokens is None:
        logger.warning(
            "sampler.max_prompt_tokens is null: prompts have no bound, so the memory plan before "
            "loading is skipped (set it to have the run checked)"
        )
        return None
    from models.hf import checkpoint_config, device_memory_bytes

    model_config = checkpoint_config(config.model_path)
    # a GPU's bytes_limit is already the client's share (XLA_PYTHON_CLIENT_MEM_FRACTION applied)
    plan = plan_memory(
        config,
        model_config,
        device_memory_bytes(),
        model_name=config.model_path,
        memory_fraction=1.0,
    )
    refusal = plan.refusal(config)
    if refusal:
        raise UserError(f"{refusal}; or memory.check_fit=false to try anyway")
    return plan


def plan_memory(
    config: MMGRPOConfig,
    model_config: ModelConfig,
    device_bytes: int,
    *,
    model_name: str = "",
    memory_fraction: float | None = None,
    compiler_options: Mapping[str, str] | None = None,
) -> MemoryPlan:
    """Compile (never run) the config's train step and sampler and read their buffer sizes.
    `compiler_options`: XLA options for these compiles only (`mmgrpo plan` on a CPU host turns
    off a CPU-only pass), whatever this process compiled before."""
    if config.sampler.max_prompt_tokens is None:
        raise UserError(
            "MMGRPOConfig.sampler.max_prompt_tokens is null: a memory plan needs the longest "
            "prompt the sampler takes"
        )
    dtype = jnp.dtype(config.dtype)
    lora = config.lora if config.train == "lora" else None
    attention = config.memory.attention_config
    if attention.implementation == "pallas" and jax.default_backend() != "gpu":
        # off a GPU the kernel is the Pallas interpreter, whose buffers say nothing of the
        # kernel's; the kernel, like blockwise, keeps one tile of scores and one float a query
        logger.warning(
            "planning memory.attention=pallas as blockwise on this %s host: the fused kernel "
            "only compiles for a GPU",
            jax.default_backend(),
        )
        attention = dataclasses.replace(attention, implementation="blockwise")
    abstract = nnx.eval_shape(
        lambda: Decoder(
            model_config,
            lora=lora,
            dtype=dtype,
            attention=attention,
            remat=config.memory.remat,
            rngs=nnx.Rngs(0),
        )
    )
    options = dict(compiler_options or {})
    train = _train_step_analysis(config, abstract, options)
    sampler = _sampler_analysis(config, abstract, options)
    weights = _nbytes(nnx.state(abstract))
    platform = jax.devices()[0].platform
    fraction = usable_fraction(platform) if memory_fraction is None else memory_fraction
    return MemoryPlan(
        model=model_name or model_config.model_type,
        weights_bytes=weights,
        state_bytes=train["state_bytes"],
        train_temp_bytes=train["temp_bytes"],
        train_step_bytes=train["total_bytes"],
        kv_cache_bytes=sampler["cache_bytes"],
        sampler_temp_bytes=sampler["temp_bytes"],
        sampler_bytes=sampler["total_bytes"] + train["state_bytes"],
        device_bytes=int(device_bytes),
        usable_bytes=int(device_bytes * fraction),
        shapes={"train micro-batch": train["shape"], "sampler batch": sampler["shape"]},
    )


def _nbytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _footprint(compiled: Any) -> tuple[int, int]:
    """(whole footprint, temporaries) of a compiled program: donated inputs counted once."""
    m = compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    ) + m.temp_size_in_bytes
    return int(total), int(m.temp_size_in_bytes)


def _spec(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _train_step_analysis(
    config: MMGRPOConfig, abstract: Decoder, options: dict[str, str]
) -> dict[str, Any]:
    optimizer = config.optim.build(config.num_steps)
    graphdef, params, base = nnx.split(abstract, config.trainable, ...)
    opt_state = jax.eval_shape(optimizer.init, params)
    key = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    state = TrainState(params, opt_state, key)
    reference = params if config.train == "full" and config.loss.beta > 0 else None
    frozen = FrozenWeights(base, reference)
    b = config.optim.micro_batch_size
    longest = config.sampler.max_prompt_tokens + config.sampler.max_completion_tokens
    length = row_length_bucket(longest)
    memory = config.memory
    pack = None
    if memory.pack:  # what pack_shape gives the longest rows: a padded micro-batch's slots
        sequence = min(memory.pack_length or length, b * length)
        pack = PackShape(max(b * length // sequence, 1), sequence)
    batch = abstract_batch(
        1,
        b,
        length,
        old_logps=config.num_iterations > 1,
        pack=pack,
        adapter_ids=config.per_module_adapters,
        window=token_bucket(config.sampler.max_completion_tokens),
        reach=memory.pack and memory.share_prompts,
    )
    step = make_train_step(
        graphdef,
        optimizer,
        config.resolved_loss,
        config.sampler.temperature,
        config.memory.logits_chunk,
    )
    total, temp = _footprint(step.lower(state, frozen, batch).compile(options))
    return {
        "total_bytes": total,
        "temp_bytes": temp,
        "state_bytes": _nbytes((params, opt_state, reference)),
        "shape": (
            f"{b} rows x {length} tokens"
            if pack is None
            else f"{pack.sequences} packed sequences x {pack.length} tokens"
        ),
    }


def abstract_batch(
    micro_batches: int,
    rows: int,
    length: int,
    old_logps: bool,
    pack: PackShape | None = None,
    adapter_ids: bool = False,
    window: int | None = None,
    reach: bool = False,
) -> Batch:
    """A `Batch` of ShapeDtypeStructs: what `pack_rows` would build at these sizes (packed:
    `pack`'s sequences, each predicting up to its length in targets, and `rows` per-row
    slots; with per-module adapters, each row's (packed: each token's) adapter id; `window`
    completion targets a row, default every position; `reach` for a prefix tree)."""
    shape = (micro_batches, rows)
    targets = (*shape, length - 1)
    window = window or length - 1
    if pack is None:
        sequences, sequence = shape, (*shape, length)
    else:
        sequences = (micro_batches, pack.sequences)
        sequence = (*sequences, pack.length)
        window = pack.length  # a sequence's targets
    packed = {
        "target_index": _spec((*sequences, window), jnp.int32),
        "target_tokens": _spec((*sequences, window), jnp.int32),
        "target_slot": _spec((*sequences, window), jnp.int32),
    }
    if pack is not None:
        packed |= {
            "positions": _spec(sequence, jnp.int32),
            "target_row": _spec((*sequences, window), jnp.int32),
            ("reach" if reach else "segments"): _spec(sequence, jnp.int32),
        }
        if adapter_ids:
            packed["token_adapters"] = _spec(sequence, jnp.int32)
    return Batch(
        tokens=_spec(sequence, jnp.int32),
        valid=_spec(sequence, jnp.bool_),
        loss_mask=_spec(targets, jnp.bool_),
        advantages=_spec(shape, jnp.float32),
        unit_ids=_spec(shape, jnp.int32),
        sampler_logps=_spec(targets, jnp.float32),
        has_sampler_logps=_spec(shape, jnp.bool_),
        num_sequences=_spec(shape[:1], jnp.float32),
        num_tokens=_spec(shape[:1], jnp.float32),
        old_logps=_spec(targets, jnp.float32) if old_logps else None,
        adapter_ids=_spec(shape, jnp.int32) if adapter_ids else None,
        **packed,
    )


def _sampler_analysis(
    config: MMGRPOConfig, abstract: Decoder, options: dict[str, str]
) -> dict[str, Any]:
    """The sampler with a full batch of the longest requests admitted at once (`generate`'s
    pool): a prefill pass of a chunk (or the whole prompt) over every row, in place, and the
    decode call."""
    s = config.sampler
    chunk = config.memory.prefill_chunk
    slots = request_slots(s.max_prompt_tokens, s.max_completion_tokens)
    steps = max(decode_steps(s.max_completion_tokens), 1)
    requests = s.batch
    if s.max_cache_tokens:  # the engine splits a larger batch: plan one call of the split
        requests = max(1, rows_within_budget(s.batch, slots, s.max_cache_tokens))
    rows = row_bucket(requests)
    width = token_bucket(min(chunk, s.max_prompt_tokens) if chunk else s.max_prompt_tokens)
    graphdef, state = nnx.split(abstract)
    rows_i32 = _spec((rows,), jnp.int32)
    sampling = RowSampling(
        keys=jax.eval_shape(lambda: jax.random.split(jax.random.key(0), rows)),  # one per row
        temperature=_spec((rows,), jnp.float32),
        top_k=rows_i32,
        top_p=_spec((rows,), jnp.float32),
        adapters=rows_i32,
    )
    filters = RowFilters(any_sampled=True, any_top_k=False, any_top_p=s.top_p < 1)
    cache = jax.eval_shape(lambda: abstract.init_cache(rows, slots))
    prefill = extend_pass.lower(
        graphdef,
        (state,),
        cache,
        None,  # every row, in place
        None,
        _spec((rows, width), jnp.int32),
        rows_i32,
        rows_i32,
        sampling,
        filters=filters,
        mesh=None,
    ).compile(options)
    decode = decode_pass.lower(
        graphdef,
        (state,),
        cache,
        None,  # every row, in place
        rows_i32,
        rows_i32,
        rows_i32,
        rows_i32,
        sampling,
        filters=filters,
        mesh=None,
        steps=steps,
        eos=(0,),
    ).compile(options)
    (prefill_total, prefill_temp), (decode_total, decode_temp) = map(_footprint, (prefill, decode))
    return {
        "total_bytes": max(prefill_total, decode_total),
        "temp_bytes": max(prefill_temp, decode_temp),
        "cache_bytes": _nbytes(cache),
        "shape": f"{rows} requests x {slots} cache slots ({width}-token prefill passes)",
    }
