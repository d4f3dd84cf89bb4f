"""One decoder for Llama 3.x, Qwen2 and Qwen3, in Flax NNX, read top to bottom:
RMSNorm -> RoPE -> attention -> MLP -> block -> model.

Shapes: B batch, T query positions, S key/value slots (T without a cache), D hidden, H query heads,
K key/value heads, Dh head dim, F MLP width, V vocabulary. Numerics follow HF: RMSNorm in float32
cast back before the weight, RoPE tables in float32 cast to the activation dtype, softmax in
float32. Loading, sharding rules and sampling live in other files.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import AttentionConfig, AttentionMask, attend
from models.config import ModelConfig, rope_inv_freq
from models.lora import Linear, LoRAConfig, UseLoRA


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * normed.astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE over HF's layout. x [B, T, H, Dh], positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None, dtype: jnp.dtype, rngs: nnx.Rngs):
        def proj(name: str, n_in: int, n_out: int, bias: bool = False) -> Linear:
            adapter = lora if lora is not None and name in lora.targets else None
            return Linear(n_in, n_out, use_bias=bias, lora=adapter, dtype=dtype, rngs=rngs)

        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = proj("q_proj", d, h * dh, cfg.attention_bias)
        self.k_proj = proj("k_proj", d, k * dh, cfg.attention_bias)
        self.v_proj = proj("v_proj", d, k * dh, cfg.attention_bias)
        self.o_proj = proj("o_proj", h * dh, d)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, dh

    def __call__(
        self,
        x: jax.Array,  # [B, T, D]
        positions: jax.Array,  # [B, T]
        mask: AttentionMask,
        inv_freq: jax.Array,  # [Dh/2]
        cache: KVCache | None,  # every layer's cache; this block reads and writes `layer`'s
        layer: jax.Array | int,
        slot: jax.Array | None,  # [B] each row's first cache slot these T positions write
        use_lora: UseLoRA,
        rngs: nnx.Rngs | None,  # LoRA dropout during training; None disables it
        attention: AttentionConfig,
    ) -> tuple[jax.Array, KVCache | None]:
        b, t, _ = x.shape
        q = self.q_proj(x, use_lora, rngs).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x, use_lora, rngs).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, use_lora, rngs).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        # Keys are stored [B, K, Dh, S] and values [B, K, S, Dh] so that both contractions are
        # plain batched matmuls: 3x faster decode attention on CPU than the [B, S, K, Dh] layout.
        k, v = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
        if cache is not None:
            # Prefill and decode write their new keys into the preallocated cache (only these
            # T slots of this layer), then attend to the layer's whole cache.
            cache = cache.replace(
                keys=_write_slots(cache.keys, k, layer, slot, axis=4),
                values=_write_slots(cache.values, v, layer, slot, axis=3),
            )
            k, v = _read_layer(cache.keys, layer), _read_layer(cache.values, layer)
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim).transpose(0, 2, 1, 3, 4)
        out = attend(q, k, v, mask, attention, cached=cache is not None)  # [B, K, T, G, Dh]
        out = out.transpose(0, 2, 1, 3, 4)
        return self.o_proj(out.reshape(b, t, -1), use_lora, rngs), cache


def _write_slots(
    cache: jax.Array, new: jax.Array, layer: jax.Array | int, slot: jax.Array, axis: int
) -> jax.Array:
    """Write `new` (one layer's [B, ...] keys or values of T positions) into `cache` along
    `axis`, each row from its own `slot` [B] on (the pool's rows sit at different lengths)."""
    new = _stored(new, cache.dtype)
    # one scatter of every row's T positions (a vmapped update_slice would copy the layer)
    b, t = new.shape[0], new.shape[axis - 1]
    rows = jnp.arange(b)[:, None]
    slots = slot[:, None] + jnp.arange(t)[None, :]  # [B, T]; past the cache: dropped
    moved = jnp.moveaxis(new, axis - 1, 1)  # [B, T, K, Dh]
    if axis == 4:  # keys [layers, B, K, Dh, S]
        return cache.at[layer, rows, :, :, slots].set(moved, mode="drop")
    return cache.at[layer, rows, :, slots, :].set(moved, mode="drop")


def cache_storage_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """What a KV cache of `dtype` keys and values is stored as: bfloat16 as its bits (uint16).

    The sampler writes each row at its own slot with a scatter, and a scatter only moves bits:
    XLA's CPU compiler widens a bfloat16 operand to float32 around it (a copy of twice the whole
    cache, which a GPU does not make and `mmgrpo plan` on a CPU host would count); on the bits
    it updates in place on every backend. Reads bitcast one layer back.
    """
    return _BF16_BITS if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


_BF16_BITS = jnp.dtype(jnp.uint16)


def _stored(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    if storage == _BF16_BITS:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), _BF16_BITS)
    return x.astype(storage)


def _read_layer(cache: jax.Array, layer: jax.Array | int) -> jax.Array:
    """One layer of the cache, bfloat16 bits bitcast back."""
    part = jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False)
    if part.dtype == _BF16_BITS:
        return jax.lax.bitcast_convert_type(part, jnp.bfloat16)
    return part


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None, dtype: jnp.dtype, rngs: nnx.Rngs):
        def proj(name: str, n_in: int, n_out: int) -> Linear:
            adapter = lora if lora is not None and name in lora.targets else None
            return Linear(n_in, n_out, lora=adapter, dtype=dtype, rngs=rngs)

        self.gate_proj = proj("gate_proj", cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = proj("up_proj", cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = proj("down_proj", cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: jax.Array, use_lora: UseLoRA, rngs: nnx.Rngs | None) -> jax.Array:
        gated = jax.nn.silu(self.gate_proj(x, use_lora, rngs)) * self.up_proj(x, use_lora, rngs)
        return self.down_proj(gated, use_lora, rngs)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, lora, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, lora, dtype, rngs)

    def __call__(self, x, positions, mask, inv_freq, cache, layer, slot, use_lora, rngs, attention):
        attn, cache = self.self_attn(
            self.input_layernorm(x),
            positions,
            mask,
            inv_freq,
            cache,
            layer,
            slot,
            use_lora,
            rngs,
            attention,
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), use_lora, rngs), cache


@flax.struct.dataclass
class KVCache:
    """Every layer's keys and values, stacked (stored as `cache_storage_dtype`). Row b holds
    one sequence from slot 0 on; a query at slot s sees slots up to s."""

    keys: jax.Array  # [layers, B, K, Dh, S]
    values: jax.Array  # [layers, B, K, S, Dh]


class Decoder(nnx.Module):
    """The policy: token ids -> logits, optionally through a KV cache, LoRA on or off.

    The blocks are one `Block` whose every variable has a leading layer axis, run by a
    `lax.scan`: compile time does not grow with depth, and under `remat` the backward pass holds
    one block's activations at a time (only the blocks' inputs are saved). `attention` picks the
    multi-token attention (dense reference or blockwise). Both are static settings of the graph,
    changeable between calls.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        lora: LoRAConfig | None = None,
        dtype: jnp.dtype = jnp.float32,
        attention: AttentionConfig | None = None,
        remat: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        self.config, self.lora, self.dtype = cfg, lora, dtype
        self.attention = attention or AttentionConfig()
        self.remat = remat
        embed = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32)
        self.embed_tokens = nnx.Param((embed * 0.02).astype(dtype))
        self.layers = stack_blocks([Block(cfg, lora, dtype, rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)
        )

    def logits(self, hidden: jax.Array) -> jax.Array:  # [..., D] -> [..., V]
        if self.lm_head is None:
            return hidden @ self.embed_tokens[...].T
        return self.lm_head(hidden)

    def hidden_states(
        self,
        input_ids: jax.Array,  # [B, T]
        positions: jax.Array,  # [B, T]
        mask: AttentionMask,
        cache: KVCache | None = None,
        slot: jax.Array | None = None,  # [B], with a cache: where each row's T positions go
        use_lora: UseLoRA = True,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        x = self.embed_tokens[...][input_ids]
        inv_freq = jnp.asarray(rope_inv_freq(self.config), jnp.float32)  # a compile-time constant
        graphdef, stacked = nnx.split(self.layers)
        # one dropout key for the pass, folded with the layer index inside the scan
        dropout_key = None if rngs is None else rngs.dropout()

        def block(carry, layer_and_index):
            x, cache = carry
            layer_state, index = layer_and_index
            layer = nnx.merge(graphdef, layer_state)
            layer_rngs = (
                None
                if dropout_key is None
                else nnx.Rngs(dropout=jax.random.fold_in(dropout_key, index))
            )
            x, cache = layer(
                x,
                positions,
                mask,
                inv_freq,
                cache,
                index,
                slot,
                use_lora,
                layer_rngs,
                self.attention,
            )
            return (x, cache), None

        if self.remat and cache is None:  # a cached pass is never differentiated
            block = jax.checkpoint(block)
        layers = (stacked, jnp.arange(self.config.num_layers))
        (x, cache), _ = jax.lax.scan(block, (x, cache), layers)
        return self.norm(x), cache

    def final_hidden(
        self,
        input_ids: jax.Array,  # [B, T]
        attention_mask: jax.Array | None = None,  # [B, T] 1 = real token, 0 = padding
        positions: jax.Array | None = None,  # [B, T]; default: count of real tokens so far
        segment_ids: jax.Array | None = None,  # [B, T] packed rows: attention stays within one
        use_lora: UseLoRA = True,
        rngs: nnx.Rngs | None = None,
        reach: jax.Array | None = None,  # [B, T] a packed prefix tree (AttentionMask.kv_reach)
    ) -> jax.Array:  # [B, T, D] after the final norm
        b, t = input_ids.shape
        valid = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
        mask = AttentionMask.causal(valid, segment_ids, reach)
        hidden, _ = self.hidden_states(input_ids, positions, mask, use_lora=use_lora, rngs=rngs)
        return hidden

    def __call__(
        self,
        input_ids: jax.Array,  # [B, T]
        positions: jax.Array | None = None,  # [B, T]; default: count of real tokens so far
        attention_mask: jax.Array | None = None,  # [B, T] 1 = real token, 0 = padding
        use_lora: UseLoRA = True,
        rngs: nnx.Rngs | None = None,  # a 'dropout' stream turns LoRA dropout on (training)
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:  # [B, T, V]
        hidden = self.final_hidden(
            input_ids, attention_mask, positions, segment_ids, use_lora, rngs
        )
        return self.logits(hidden)

    def init_cache(self, batch: int, slots: int, device: Any = None) -> KVCache:
        """An empty cache of `batch` rows x `slots` slots (placed with `device`: a sharding)."""
        cfg = self.config
        shape = (cfg.num_layers, batch, cfg.num_kv_heads)
        dtype = cache_storage_dtype(self.dtype)
        return KVCache(
            jnp.zeros((*shape, cfg.head_dim, slots), dtype, device=device),
            jnp.zeros((*shape, slots, cfg.head_dim), dtype, device=device),
        )


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose variables stack the given blocks' along a new leading layer axis."""
    graphdef, *_ = nnx.split(blocks[0])
    states = [nnx.state(b) for b in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))
