"""mmgrpo-jax: multi-module GRPO for LM programs in JAX.

The names a researcher reaches for first; everything else lives in its package by role:
`program` (signatures, modules, traces), `rl` (rollouts, grouping, advantages, losses, batching,
the jitted step), `engines` (the rollout-engine protocol, the JAX engine, OpenAI-compatible LMs),
`sampler` (the jitted sampler), `trainer` (the MMGRPO loop, checkpoints, run logs),
`prompt_opt` (MIPROv2, BetterTogether), `cli` (the `mmgrpo` command), `testing` (scripted LMs,
tiny policies). The names are imported on first use, so `import mmgrpo_jax.engines.base` (the
engine protocol) or `mmgrpo_jax.program` loads no JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmgrpo_jax.engines.base import Request, RolloutEngine, Sampling
    from mmgrpo_jax.engines.jax_engine import JaxEngine
    from mmgrpo_jax.engines.lm import EngineLM
    from mmgrpo_jax.rl.advantages import GroupStats, register_advantage_scale
    from mmgrpo_jax.rl.grouping import Group, GroupingSettings, GroupMember, register_grouping
    from mmgrpo_jax.rl.losses import (
        LossConfig,
        TokenInputs,
        TokenTerms,
        UnitSums,
        register_aggregation,
        register_loss,
    )
    from mmgrpo_jax.trainer.config import MemoryConfig, MMGRPOConfig, OptimConfig, SamplerConfig
    from mmgrpo_jax.trainer.mmgrpo import MMGRPO

_HOME = {  # each first name and the module that holds it, imported on first use
    "Request": "mmgrpo_jax.engines.base",
    "RolloutEngine": "mmgrpo_jax.engines.base",
    "Sampling": "mmgrpo_jax.engines.base",
    "JaxEngine": "mmgrpo_jax.engines.jax_engine",
    "EngineLM": "mmgrpo_jax.engines.lm",
    "GroupStats": "mmgrpo_jax.rl.advantages",
    "register_advantage_scale": "mmgrpo_jax.rl.advantages",
    "Group": "mmgrpo_jax.rl.grouping",
    "GroupMember": "mmgrpo_jax.rl.grouping",
    "GroupingSettings": "mmgrpo_jax.rl.grouping",
    "register_grouping": "mmgrpo_jax.rl.grouping",
    "LossConfig": "mmgrpo_jax.rl.losses",
    "TokenInputs": "mmgrpo_jax.rl.losses",
    "TokenTerms": "mmgrpo_jax.rl.losses",
    "UnitSums": "mmgrpo_jax.rl.losses",
    "register_aggregation": "mmgrpo_jax.rl.losses",
    "register_loss": "mmgrpo_jax.rl.losses",
    "MMGRPOConfig": "mmgrpo_jax.trainer.config",
    "MemoryConfig": "mmgrpo_jax.trainer.config",
    "OptimConfig": "mmgrpo_jax.trainer.config",
    "SamplerConfig": "mmgrpo_jax.trainer.config",
    "MMGRPO": "mmgrpo_jax.trainer.mmgrpo",
}

__all__ = [
    "MMGRPO",
    "EngineLM",
    "Group",
    "GroupMember",
    "GroupStats",
    "GroupingSettings",
    "JaxEngine",
    "LossConfig",
    "MMGRPOConfig",
    "MemoryConfig",
    "OptimConfig",
    "Request",
    "RolloutEngine",
    "SamplerConfig",
    "Sampling",
    "TokenInputs",
    "TokenTerms",
    "UnitSums",
    "register_advantage_scale",
    "register_aggregation",
    "register_grouping",
    "register_loss",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'mmgrpo_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])
