"""The policy a run trains and the engine it samples through: loaded from a checkpoint (or
passed in) with the config's memory settings, and the default engine on it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mmgrpo_jax.engines.base import RolloutEngine
from mmgrpo_jax.engines.continuous import DEFAULT_PREFILL_CHUNK, ContinuousEngine
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.engines.local import LocalEngine
from mmgrpo_jax.trainer.config import MMGRPOConfig
from models.decoder import Decoder
from models.hf import load_checkpoint
from models.tokenizer import HFTokenizer

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


def engine_or_factory(
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
