"""mmgrpo-jax: multi-module GRPO for LM programs in JAX.

The names a researcher reaches for first; everything else lives in its package by role:
`program` (signatures, modules, traces), `rl` (rollouts, grouping, advantages, losses, batching,
the jitted step), `engines` (the rollout-engine protocol, the JAX engine, OpenAI-compatible LMs),
`sampling` (the jitted sampler), `trainer` (the MMGRPO loop, checkpoints, run logs),
`prompt_opt` (MIPROv2, BetterTogether), `cli` (the `mmgrpo` command), `testing` (scripted LMs,
tiny policies).
"""

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
