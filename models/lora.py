"""LoRA adapters with PEFT conventions, and the linear layer that carries them.

y = x W (+ b) + (alpha / r) * (dropout(x) A) B, A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming
init), B = 0 so a fresh adapter changes nothing. A and B are `nnx.LoRAParam`; the base kernel is
a plain `nnx.Param`, so `nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))` selects base weights.
`use_lora=False` at call time runs the base model (the KL reference) from the same weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / rank (PEFT's convention)
    targets: tuple[str, ...] = TARGETS  # the projections that carry an adapter
    dropout: float = 0.0  # on the adapter's input, in training only

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha}")
        unknown = sorted(set(self.targets) - set(TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"LoRAConfig.targets must be a non-empty subset of {TARGETS}, got {self.targets}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class Linear(nnx.Module):
    """A bias-optional linear layer, kernel [in, out], with an optional LoRA adapter."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = False,
        lora: LoRAConfig | None = None,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.kernel = nnx.Param(
            nnx.initializers.lecun_normal()(rngs.params(), (in_features, out_features), dtype)
        )
        self.bias = nnx.Param(jnp.zeros((out_features,), dtype)) if use_bias else None
        self.lora = lora
        if lora is not None:
            bound = 1.0 / in_features**0.5
            a = jax.random.uniform(
                rngs.params(), (in_features, lora.rank), jnp.float32, -bound, bound
            )
            self.lora_a = nnx.LoRAParam(a.astype(dtype))
            self.lora_b = nnx.LoRAParam(jnp.zeros((lora.rank, out_features), dtype))
            self.dropout = nnx.Dropout(lora.dropout) if lora.dropout > 0 else None

    def __call__(
        self, x: jax.Array, use_lora: bool = True, rngs: nnx.Rngs | None = None
    ) -> jax.Array:
        y = x @ self.kernel[...]
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is not None and use_lora:
            # Dropout on the adapter's input only (PEFT), and only when a training stream is given.
            h = x
            if self.dropout is not None and rngs is not None:
                h = self.dropout(x, deterministic=False, rngs=rngs)
            y = y + ((h @ self.lora_a[...]) @ self.lora_b[...]) * jnp.asarray(
                self.lora.scaling, y.dtype
            )
        return y

    def merged_kernel(self) -> jax.Array:
        """W + (alpha/r) A B, computed in float32 and cast back."""
        kernel = self.kernel[...]
        if self.lora is None:
            return kernel
        delta = self.lora_a[...].astype(jnp.float32) @ self.lora_b[...].astype(jnp.float32)
        return (kernel.astype(jnp.float32) + delta * self.lora.scaling).astype(kernel.dtype)
