"""How a row draws its next token: temperature, top-k and top-p per row, from the row's own key.

Every row of a pass carries its own settings, so requests with different settings share a pass
and a row draws exactly what it would draw alone (docs/design.md#determinism). The log-prob
reported is the log-softmax of the logits over the temperature (T = 1 when greedy), over the
full vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RowFilters:
    """Which filters some row of a pass uses: static, so a pass without them skips them."""

    any_sampled: bool
    any_top_k: bool
    any_top_p: bool


def sample_rows(
    logits: jax.Array,  # [B, V]
    keys: jax.Array,  # [B] the key of each row's token (already folded with its index)
    temperature: jax.Array,  # [B] 0 = greedy
    top_k: jax.Array,  # [B] 0 = off
    top_p: jax.Array,  # [B] 1 = off
    filters: RowFilters,
) -> tuple[jax.Array, jax.Array]:
    """(token [B], logprob [B]): argmax for greedy rows, else a draw from the row's key of the
    tempered logits restricted to its top-k and then its nucleus."""
    greedy = temperature <= 0
    scaled = logits.astype(jnp.float32)
    argmax = jnp.argmax(scaled, axis=-1)
    if not filters.any_sampled:
        return argmax.astype(jnp.int32), chosen_logprob(scaled, argmax)
    scaled = scaled / jnp.where(greedy, 1.0, temperature)[:, None]
    filtered = scaled
    if filters.any_top_k:
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
        kth = jnp.take_along_axis(ordered, jnp.maximum(top_k - 1, 0)[:, None], axis=-1)
        kth = jnp.where(top_k[:, None] > 0, kth, -jnp.inf)
        filtered = jnp.where(scaled < kth, -jnp.inf, filtered)
    if filters.any_top_p:
        filtered = jnp.where(top_p[:, None] < 1.0, nucleus(filtered, top_p[:, None]), filtered)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered)
    token = jnp.where(greedy, argmax, drawn)
    return token.astype(jnp.int32), chosen_logprob(scaled, token)


def nucleus(filtered: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """Top-p filtering of [B, V] scaled logits (`top_p` a float or [B, 1]): keep the most likely
    tokens whose mass before them is under top_p."""
    ordered = jnp.sort(filtered, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
    kept = jnp.where(before < top_p, ordered, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    return jnp.where(filtered < threshold, -jnp.inf, filtered)


def chosen_logprob(scaled: jax.Array, token: jax.Array) -> jax.Array:
    """log-softmax at the chosen token only: the full [B, V] log-softmax is never materialised."""
    chosen = jnp.take_along_axis(scaled, token[:, None], axis=-1)[:, 0]
    return chosen - jax.nn.logsumexp(scaled, axis=-1)


def fold_in_rows(keys: jax.Array, data: jax.Array | int) -> jax.Array:
    """Every row's key folded with its data (or all with the same: the index of the token
    they draw)."""
    in_axes = (0, 0 if jnp.ndim(data) else None)
    return jax.vmap(jax.random.fold_in, in_axes=in_axes)(keys, data)
