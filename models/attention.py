"""Attention over a compact mask: the dense reference, a blockwise online-softmax path, and a
fused GPU kernel.

Dense attention materialises [B, heads, T, S] float32 scores; at 8,192 tokens that is ~8 GiB per
row and layer, kept for the backward pass. The blockwise path (flash-attention style, any backend)
walks query blocks x key blocks with a running max and sum, never holds more than one block of
scores, skips key blocks that every query of a block is causally barred from, and has its own
backward pass (a custom VJP that recomputes the block scores from the saved log-sum-exp), so the
backward keeps only the output and one float per query.

The fused kernel is Pallas's Triton flash attention (jax.experimental.pallas.ops.gpu), with
segment ids for packed rows, for the passes without a KV cache (training and log-probs, where
memory and time go); passes with a cache (the sampler) run blockwise. On other backends it runs in
the Pallas interpreter (slow: for the parity tests only).

Layouts are the decoder's: q [B, K, T, G, Dh] (G query heads share each of the K key/value heads),
keys [B, K, Dh, S] and values [B, K, S, Dh] (the KV cache's layout: no transpose of the cache).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp

Implementation = Literal["dense", "blockwise", "pallas"]
IMPLEMENTATIONS: tuple[str, ...] = ("dense", "blockwise", "pallas")
PALLAS_MAX_BLOCK = 128  # the Triton kernel's tiles: larger ones exceed a GPU's shared memory


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention the decoder runs for multi-token passes (training, log-probs, prefill).

    Single-token decode steps always attend densely: their scores are one row per head.
    """

    implementation: Implementation = "dense"
    q_block: int = 512
    kv_block: int = 512

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"attention implementation {self.implementation!r} is not one of {IMPLEMENTATIONS}"
            )
        for name in ("q_block", "kv_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"AttentionConfig.{name} must be >= 1, got {getattr(self, name)}")


@flax.struct.dataclass
class AttentionMask:
    """Query t (sitting at cache slot `q_slots[b, t]`) sees slot s iff s <= its slot, slot s
    holds a real token, (packed rows) slot s's segment is the query's own, and (a packed prefix
    tree) the query's slot is before `kv_reach[b, s]`.

    A prefix tree is laid out depth first, so the tokens below a token (every row that shares
    it) are the contiguous slots after it, up to its reach: "the query lies in slot s's
    subtree" is `s <= slot < reach[s]`, one comparison, for a tree of any depth."""

    q_slots: jax.Array  # [B, T] int32; -1 = a query that sees nothing
    kv_valid: jax.Array  # [B, S] bool
    q_segments: jax.Array | None = None  # [B, T] int32
    kv_segments: jax.Array | None = None  # [B, S] int32
    kv_reach: jax.Array | None = None  # [B, S] int32: the slot after slot s's subtree

    @classmethod
    def causal(
        cls,
        valid: jax.Array,
        segments: jax.Array | None = None,
        reach: jax.Array | None = None,
    ) -> AttentionMask:
        """Self-attention over one sequence per row (training, log-probs): query t is slot t."""
        b, t = valid.shape
        slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        return cls(slots, valid.astype(bool), segments, segments, reach)

    def allowed(self, q_start, q_len: int, kv_start, kv_len: int) -> jax.Array:
        """[B, q_len, kv_len] bool for a block of queries and a block of slots."""
        slots = jax.lax.dynamic_slice_in_dim(self.q_slots, q_start, q_len, 1)
        kv = kv_start + jnp.arange(kv_len, dtype=jnp.int32)
        ok = kv[None, None, :] <= slots[:, :, None]
        ok &= jax.lax.dynamic_slice_in_dim(self.kv_valid, kv_start, kv_len, 1)[:, None, :]
        if self.q_segments is not None:
            q_seg = jax.lax.dynamic_slice_in_dim(self.q_segments, q_start, q_len, 1)
            kv_seg = jax.lax.dynamic_slice_in_dim(self.kv_segments, kv_start, kv_len, 1)
            ok &= q_seg[:, :, None] == kv_seg[:, None, :]
        if self.kv_reach is not None:
            reach = jax.lax.dynamic_slice_in_dim(self.kv_reach, kv_start, kv_len, 1)
            ok &= slots[:, :, None] < reach[:, None, :]
        return ok

    def dense(self) -> jax.Array:
        """[B, T, S] bool."""
        return self.allowed(0, self.q_slots.shape[1], 0, self.kv_valid.shape[1])

    def padded(self, queries: int, slots: int) -> AttentionMask:
        """Extra queries that see nothing and extra slots that hold nothing."""
        dq, ds = queries - self.q_slots.shape[1], slots - self.kv_valid.shape[1]

        def pad(x, n, value):
            return x if n == 0 else jnp.pad(x, ((0, 0), (0, n)), constant_values=value)

        seg = self.q_segments is not None
        return AttentionMask(
            pad(self.q_slots, dq, -1),
            pad(self.kv_valid, ds, False),
            pad(self.q_segments, dq, -1) if seg else None,
            pad(self.kv_segments, ds, -2) if seg else None,
            None if self.kv_reach is None else pad(self.kv_reach, ds, -1),
        )


def attend(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: AttentionMask,
    config: AttentionConfig,
    cached: bool = False,
) -> jax.Array:
    """[B, K, T, G, Dh] attention output in q's dtype; single-token queries always go dense.
    `cached`: the keys are a KV cache's slots (not the queries' own tokens)."""
    if config.implementation == "dense" or q.shape[2] == 1:
        return dense_attention(q, keys, values, mask)
    if config.implementation == "pallas" and not cached:
        return pallas_attention(q, keys, values, mask, config.q_block, config.kv_block)
    return blockwise_attention(q, keys, values, mask, config.q_block, config.kv_block)


def pallas_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: AttentionMask,
    q_block: int = PALLAS_MAX_BLOCK,
    kv_block: int = PALLAS_MAX_BLOCK,
) -> jax.Array:
    """Self-attention of T tokens (query t at slot t, no cache) by the fused Pallas kernel:
    causal within each segment (packed rows) or over the valid tokens. A padding query sees
    the padding before it (its output is never used) where the other paths give it zeros."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_gpu

    b, k, t, g, dh = q.shape
    if keys.shape[-1] != t:
        raise ValueError(
            f"pallas attention is self-attention: {t} queries but {keys.shape[-1]} keys"
        )
    if mask.kv_reach is not None:
        raise ValueError(
            "the Pallas attention kernel takes segment ids only, not a packed prefix tree's "
            "reach; with memory.share_prompts use memory.attention 'dense' or 'blockwise'"
        )
    segments = mask.q_segments
    if segments is None:  # right-padded rows: padding is a segment of its own
        segments = jnp.where(mask.kv_valid, 0, -1).astype(jnp.int32)
    heads = k * g
    queries = q.transpose(0, 2, 1, 3, 4).reshape(b, t, heads, dh)
    # each key / value head serves its G query heads: heads k*G .. k*G+G-1, HF's order
    keys = jnp.repeat(keys.transpose(0, 3, 1, 2), g, axis=2).astype(q.dtype)  # [B, S, N, Dh]
    values = jnp.repeat(values.transpose(0, 2, 1, 3), g, axis=2).astype(q.dtype)
    block_q = math.gcd(t, min(q_block, PALLAS_MAX_BLOCK))
    block_k = math.gcd(t, min(kv_block, PALLAS_MAX_BLOCK))
    backward = min(block_q, block_k, 32)
    sizes = pallas_gpu.BlockSizes(
        block_q=block_q,
        block_k=block_k,
        block_q_dkv=backward,
        block_kv_dkv=backward,
        block_q_dq=backward,
        block_kv_dq=backward,
    )
    out = pallas_gpu.mha(
        queries,
        keys,
        values,
        segments,
        sm_scale=dh**-0.5,
        causal=True,
        block_sizes=sizes,
        interpret=jax.default_backend() != "gpu",
    )
    return out.reshape(b, t, k, g, dh).transpose(0, 2, 1, 3, 4)


def dense_attention(
    q: jax.Array, keys: jax.Array, values: jax.Array, mask: AttentionMask
) -> jax.Array:
    """The reference: HF's numerics (scores in the activation dtype, softmax in float32)."""
    b, k, t, g, dh = q.shape
    # query positions and their group folded into one row axis: plain batched matmuls
    rows = q.reshape(b, k, t * g, dh)
    scores = jnp.matmul(rows, keys.astype(q.dtype)) * dh**-0.5  # [B, K, T*G, S]
    allowed = jnp.repeat(mask.dense(), g, axis=1)[:, None]  # [B, 1, T*G, S]
    scores = jnp.where(allowed, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.matmul(probs, values.astype(q.dtype)).reshape(b, k, t, g, dh)


def blockwise_attention(
    q: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    mask: AttentionMask,
    q_block: int = 512,
    kv_block: int = 512,
) -> jax.Array:
    """Online-softmax attention in [q_block x kv_block] tiles; equals `dense_attention` on every
    query that sees at least one slot (a query that sees none gets zeros, not a uniform mean)."""
    t, s = q.shape[2], keys.shape[3]
    q_block, kv_block = min(q_block, t), min(kv_block, s)
    t_pad, s_pad = -(-t // q_block) * q_block, -(-s // kv_block) * kv_block
    if t_pad != t:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, t_pad - t), (0, 0), (0, 0)))
    if s_pad != s:
        keys = jnp.pad(keys, ((0, 0), (0, 0), (0, 0), (0, s_pad - s)))
        values = jnp.pad(values, ((0, 0), (0, 0), (0, s_pad - s), (0, 0)))
    out = _flash(
        q,
        keys.astype(q.dtype),
        values.astype(q.dtype),
        mask.padded(t_pad, s_pad),
        q_block,
        kv_block,
    )
    return out[:, :, :t]


def _tile(x: jax.Array, start, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _scores(q_tile, k_tile, mask, i, j, q_block, kv_block) -> jax.Array:
    """[B, K, tq, G, tk] float32 scaled scores, -inf where barred."""
    s = jnp.einsum("bktgd,bkds->bktgs", q_tile, k_tile, preferred_element_type=jnp.float32)
    s = s * q_tile.shape[-1] ** -0.5
    allowed = mask.allowed(i * q_block, q_block, j * kv_block, kv_block)[:, None, :, None, :]
    return jnp.where(allowed, s, -jnp.inf)


def _kv_blocks_needed(mask: AttentionMask, i, q_block: int, kv_block: int, num_kv: int):
    """Key blocks [0, n) hold every slot a query of block i may see (s <= its slot)."""
    top = jnp.max(_tile(mask.q_slots, i * q_block, q_block, 1))
    return jnp.clip(top // kv_block + 1, 0, num_kv)


def _flash_forward(q, keys, values, mask, q_block, kv_block):
    b, k, t, g, dh = q.shape
    num_q, num_kv = t // q_block, keys.shape[3] // kv_block

    def query_block(i):
        q_tile = _tile(q, i * q_block, q_block, 2)

        def key_block(j, carry):
            running_max, running_sum, acc = carry
            s = _scores(
                q_tile, _tile(keys, j * kv_block, kv_block, 3), mask, i, j, q_block, kv_block
            )
            new_max = jnp.maximum(running_max, s.max(-1))
            safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            p = jnp.exp(s - safe_max[..., None])
            rescale = jnp.exp(running_max - safe_max)
            v_tile = _tile(values, j * kv_block, kv_block, 2)
            pv = jnp.einsum(
                "bktgs,bksd->bktgd",
                p.astype(values.dtype),
                v_tile,
                preferred_element_type=jnp.float32,
            )
            return new_max, running_sum * rescale + p.sum(-1), acc * rescale[..., None] + pv

        shape = (b, k, q_block, g)
        init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, dh)))
        last = _kv_blocks_needed(mask, i, q_block, kv_block, num_kv)
        running_max, running_sum, acc = jax.lax.fori_loop(0, last, key_block, init)
        seen = running_sum > 0
        out = acc / jnp.where(seen, running_sum, 1.0)[..., None]
        # +inf for a query that saw nothing: its recomputed probabilities are exp(-inf) = 0
        lse = jnp.where(seen, running_max + jnp.log(jnp.where(seen, running_sum, 1.0)), jnp.inf)
        return out.astype(q.dtype), lse

    out, lse = jax.lax.map(query_block, jnp.arange(num_q))  # [nq, B, K, tq, G, ...]
    out = jnp.moveaxis(out, 0, 2).reshape(b, k, t, g, dh)
    lse = jnp.moveaxis(lse, 0, 2).reshape(b, k, t, g)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, keys, values, mask, q_block, kv_block):
    return _flash_forward(q, keys, values, mask, q_block, kv_block)[0]


def _flash_fwd(q, keys, values, mask, q_block, kv_block):
    out, lse = _flash_forward(q, keys, values, mask, q_block, kv_block)
    return out, (q, keys, values, mask, out, lse)


def _flash_bwd(q_block, kv_block, residuals, d_out):
    """FlashAttention-2's backward: per key block, walk the query blocks that may see it."""
    q, keys, values, mask, out, lse = residuals
    num_q, num_kv = q.shape[2] // q_block, keys.shape[3] // kv_block
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,K,T,G]
    top_slot = jnp.max(mask.q_slots.reshape(mask.q_slots.shape[0], num_q, q_block), axis=(0, 2))

    def key_block(dq, j):
        k_tile = _tile(keys, j * kv_block, kv_block, 3)
        v_tile = _tile(values, j * kv_block, kv_block, 2)

        def query_block(i, carry):
            def contribute(carry):
                dq, dk, dv = carry
                q_tile = _tile(q, i * q_block, q_block, 2)
                do_tile = _tile(d_out, i * q_block, q_block, 2)
                s = _scores(q_tile, k_tile, mask, i, j, q_block, kv_block)
                p = jnp.exp(s - _tile(lse, i * q_block, q_block, 2)[..., None])
                dv = dv + jnp.einsum(
                    "bktgs,bktgd->bksd",
                    p.astype(q.dtype),
                    do_tile,
                    preferred_element_type=jnp.float32,
                )
                dp = jnp.einsum(
                    "bktgd,bksd->bktgs", do_tile, v_tile, preferred_element_type=jnp.float32
                )
                ds = (p * (dp - _tile(delta, i * q_block, q_block, 2)[..., None])).astype(q.dtype)
                ds = ds * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
                dq_tile = jnp.einsum(
                    "bktgs,bkds->bktgd", ds, k_tile, preferred_element_type=jnp.float32
                )
                dq = jax.lax.dynamic_update_slice_in_dim(
                    dq, _tile(dq, i * q_block, q_block, 2) + dq_tile, i * q_block, 2
                )
                dk = dk + jnp.einsum(
                    "bktgs,bktgd->bkds", ds, q_tile, preferred_element_type=jnp.float32
                )
                return dq, dk, dv

            # a query block whose every slot precedes this key block contributes nothing
            return jax.lax.cond(top_slot[i] >= j * kv_block, contribute, lambda c: c, carry)

        b, k = keys.shape[:2]
        dk = jnp.zeros((b, k, keys.shape[2], kv_block), jnp.float32)
        dv = jnp.zeros((b, k, kv_block, values.shape[3]), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(0, num_q, query_block, (dq, dk, dv))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(num_kv))
    b, k, dh = keys.shape[:3]
    dk = jnp.moveaxis(dk, 0, 3).reshape(b, k, dh, num_kv * kv_block)
    dv = jnp.moveaxis(dv, 0, 2).reshape(b, k, num_kv * kv_block, values.shape[3])
    return dq.astype(q.dtype), dk.astype(keys.dtype), dv.astype(values.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)
