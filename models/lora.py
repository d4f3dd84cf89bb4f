"""LoRA adapters with PEFT conventions, and the linear layer that carries them.

y = x W (+ b) + (alpha / r) * (dropout(x) A) B, A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming
init), B = 0 so a fresh adapter changes nothing. A and B are `nnx.LoRAParam`; the base kernel is
a plain `nnx.Param`, so `nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))` selects base weights.
`use_lora=False` at call time runs the base model (the KL reference) from the same weights.

Several adapters (per-module LoRA, `LoRAConfig.modules`) are stacked on a leading adapter axis,
A [n, in, r] and B [n, r, out], so that one pass serves a batch whose rows use different
adapters: `use_lora` is then an int array [B] of adapter ids, row b adding x_b A[id_b] B[id_b],
or [B, T] of one id per token (packed rows of several modules share a sequence): every token
runs through all n adapters' A, the rows of the ones it does not use zeroed, then one
contraction over (adapter, rank) against the stacked B, a rank n*r update. With one adapter
the factors keep their unstacked shapes and arithmetic (`use_lora=True`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_ADAPTER = "default"

# True: the adapter (of a model with one); False: the base model; an int array [B]: row b's
# adapter id in a model with several ([B, T]: token t's)
UseLoRA = bool | jax.Array


def _note(text: str) -> dict[str, str]:
    """A config field's help, as `mmgrpo_jax.config_files.setting` keeps it (`models` sits below
    that module): `help` for --help and the CLI reference, `description` for the API pages."""
    return {"help": text, "description": text}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 16
    alpha: float = dataclasses.field(
        default=32.0, metadata=_note("the update is scaled by alpha / rank (PEFT's convention)")
    )
    targets: tuple[str, ...] = dataclasses.field(
        default=TARGETS, metadata=_note("the projections that carry an adapter")
    )
    dropout: float = dataclasses.field(
        default=0.0, metadata=_note("on the adapter's input, in training only")
    )
    modules: tuple[str, ...] = dataclasses.field(
        default=(),
        metadata=_note(
            'per-module adapters: "pattern=adapter" entries, fnmatch patterns over the '
            "program's predictor names (named_predictors()), the first match wins; () is one "
            "adapter for all"
        ),
    )

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
        object.__setattr__(self, "modules", tuple(self.modules))
        for entry in self.modules:
            pattern, _, name = str(entry).partition("=")
            if not pattern.strip() or not name.strip() or "=" in name:
                raise ValueError(
                    f"LoRAConfig.modules entries are 'pattern=adapter' (e.g. 'query*=query'), "
                    f"got {entry!r}"
                )
            if not re.fullmatch(r"[A-Za-z0-9_-]+", name.strip()):
                raise ValueError(
                    f"LoRAConfig.modules adapter names are letters, digits, '_' and '-' (each "
                    f"names its export folder), got {name.strip()!r} in {entry!r}"
                )

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def rules(self) -> tuple[tuple[str, str], ...]:
        """(predictor-name pattern, adapter name) pairs, in the order they are tried."""
        pairs = (entry.partition("=") for entry in self.modules)
        return tuple((pattern.strip(), name.strip()) for pattern, _, name in pairs)

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The adapters, in the order of their first mention: index = adapter id."""
        names = dict.fromkeys(name for _, name in self.rules)
        return tuple(names) or (DEFAULT_ADAPTER,)

    @property
    def num_adapters(self) -> int:
        return len(self.adapter_names)

    def adapter_id(self, predictor: str) -> int:
        """The id of the adapter that serves `predictor` (a named_predictors() name)."""
        if not self.modules:
            return 0
        for pattern, name in self.rules:
            if fnmatch.fnmatchcase(predictor, pattern):
                return self.adapter_names.index(name)
        raise ValueError(
            f"predictor {predictor!r} matches no LoRAConfig.modules pattern "
            f"{[p for p, _ in self.rules]}; add one (a last '*=<adapter>' catches the rest)"
        )

    def check_predictors(self, names: Sequence[str]) -> dict[str, int]:
        """Every predictor's adapter id; raises naming a predictor no pattern matches, an
        adapter no predictor uses (it would never be trained), or a pattern that chooses no
        predictor (a typo beside working patterns would otherwise pass unnoticed)."""
        ids = {name: self.adapter_id(name) for name in names}
        unused = [a for i, a in enumerate(self.adapter_names) if i not in ids.values()]
        if self.modules and unused:
            raise ValueError(
                f"LoRAConfig.modules adapters {unused} serve none of the program's predictors "
                f"{sorted(ids)}"
            )
        chosen = {self._first_rule(name) for name in names}
        dead = [entry for i, entry in enumerate(self.modules) if i not in chosen]
        if dead:
            raise ValueError(
                f"LoRAConfig.modules entries {dead} choose none of the program's predictors "
                f"{sorted(ids)} (no match, or an earlier pattern takes them first)"
            )
        return ids

    def _first_rule(self, predictor: str) -> int | None:
        return next(
            (i for i, (p, _) in enumerate(self.rules) if fnmatch.fnmatchcase(predictor, p)), None
        )


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
            stack = (lora.num_adapters,) if lora.num_adapters > 1 else ()
            a = jax.random.uniform(
                rngs.params(), (*stack, in_features, lora.rank), jnp.float32, -bound, bound
            )
            self.lora_a = nnx.LoRAParam(a.astype(dtype))
            self.lora_b = nnx.LoRAParam(jnp.zeros((*stack, lora.rank, out_features), dtype))
            self.dropout = nnx.Dropout(lora.dropout) if lora.dropout > 0 else None

    def __call__(
        self, x: jax.Array, use_lora: UseLoRA = True, rngs: nnx.Rngs | None = None
    ) -> jax.Array:  # x [..., in] (rows first when use_lora holds adapter ids)
        y = x @ self.kernel[...]
        if self.bias is not None:
            y = y + self.bias[...]
        if self.lora is None or use_lora is False:
            return y
        # Dropout on the adapter's input only (PEFT), and only when a training stream is given.
        h = x
        if self.dropout is not None and rngs is not None:
            h = self.dropout(x, deterministic=False, rngs=rngs)
        scaling = jnp.asarray(self.lora.scaling, y.dtype)
        if self.lora.num_adapters == 1:
            if use_lora is not True:
                raise ValueError(
                    "adapter ids given to a layer with one adapter; pass use_lora=True or False"
                )
            return y + ((h @ self.lora_a[...]) @ self.lora_b[...]) * scaling
        if use_lora is True:
            raise ValueError(
                f"this layer has {self.lora.num_adapters} adapters "
                f"{list(self.lora.adapter_names)}: pass use_lora as adapter ids, one per row"
            )
        if use_lora.ndim == 2:  # one adapter id per token [B, T]: x is [B, T, in]
            chosen = jax.nn.one_hot(use_lora, self.lora.num_adapters, dtype=h.dtype)
            low = jnp.einsum("bti,nir->btnr", h, self.lora_a[...]) * chosen[..., None]
            return y + jnp.einsum("btnr,nro->bto", low, self.lora_b[...]) * scaling
        a = jnp.take(self.lora_a[...], use_lora, axis=0)  # [B, in, r]
        b = jnp.take(self.lora_b[...], use_lora, axis=0)  # [B, r, out]
        low = jnp.einsum("b...i,bir->b...r", h, a)
        return y + jnp.einsum("b...r,bro->b...o", low, b) * scaling

    def merged_kernel(self, adapter: int = 0) -> jax.Array:
        """W + (alpha/r) A B of adapter `adapter`, computed in float32 and cast back."""
        kernel = self.kernel[...]
        if self.lora is None:
            return kernel
        a, b = self.lora_a[...], self.lora_b[...]
        if self.lora.num_adapters > 1:  # [..., n, in, r]: any leading (layer) axes kept
            a, b = a[..., adapter, :, :], b[..., adapter, :, :]
        elif adapter != 0:
            raise ValueError(f"adapter {adapter} of a layer with one adapter")
        delta = a.astype(jnp.float32) @ b.astype(jnp.float32)
        return (kernel.astype(jnp.float32) + delta * self.lora.scaling).astype(kernel.dtype)
