"""One decoder for Llama 3.x, Qwen2 and Qwen3, in Flax NNX, read top to bottom:
RMSNorm -> RoPE -> attention -> MLP -> block -> model.

Shapes: B batch, T query positions, S key/value slots (T without a cache), D hidden, H query heads,
K key/value heads, Dh head dim, F MLP width, V vocabulary. Numerics follow HF: RMSNorm in float32
cast back before the weight, RoPE tables in float32 cast to the activation dtype, softmax in
float32. Loading, sharding rules and sampling live in other files.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig, rope_inv_freq
from models.lora import Linear, LoRAConfig


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


@flax.struct.dataclass
class LayerCache:
    keys: jax.Array  # [B, K, Dh, S]
    values: jax.Array  # [B, K, S, Dh]


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
        mask: jax.Array,  # [B, T, S] bool: query t may attend to slot s
        inv_freq: jax.Array,  # [Dh/2]
        cache: LayerCache | None,
        slot: jax.Array | int,  # first cache slot written by these T positions
        use_lora: bool,
        rngs: nnx.Rngs | None,  # LoRA dropout during training; None disables it
    ) -> tuple[jax.Array, LayerCache | None]:
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
            # Prefill and decode write their keys into the preallocated cache, then attend to it.
            k = jax.lax.dynamic_update_slice_in_dim(cache.keys, k.astype(cache.keys.dtype), slot, 3)
            v = jax.lax.dynamic_update_slice_in_dim(
                cache.values, v.astype(cache.values.dtype), slot, 2
            )
            cache = LayerCache(k, v)
            if isinstance(slot, int):  # prefill: slots past the prompt are still empty
                k, v, mask = k[..., : slot + t], v[:, :, : slot + t], mask[..., : slot + t]
        # Fold each kv head's query group and the query positions into one row axis (q row
        # index = t * G + g), so grouped-query attention needs no repeated keys.
        groups = self.num_heads // self.num_kv_heads
        q = q.reshape(b, t, self.num_kv_heads, groups, self.head_dim).transpose(0, 2, 1, 3, 4)
        q = q.reshape(b, self.num_kv_heads, t * groups, self.head_dim)
        scores = jnp.matmul(q, k.astype(q.dtype)) * self.head_dim**-0.5  # [B, K, T*G, S]
        row_mask = jnp.repeat(mask, groups, axis=1)[:, None]  # [B, 1, T*G, S]
        scores = jnp.where(row_mask, scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
        out = jnp.matmul(probs, v.astype(q.dtype))  # [B, K, T*G, Dh]
        out = out.reshape(b, self.num_kv_heads, t, groups, self.head_dim).transpose(0, 2, 1, 3, 4)
        return self.o_proj(out.reshape(b, t, -1), use_lora, rngs), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None, dtype: jnp.dtype, rngs: nnx.Rngs):
        def proj(name: str, n_in: int, n_out: int) -> Linear:
            adapter = lora if lora is not None and name in lora.targets else None
            return Linear(n_in, n_out, lora=adapter, dtype=dtype, rngs=rngs)

        self.gate_proj = proj("gate_proj", cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = proj("up_proj", cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = proj("down_proj", cfg.intermediate_size, cfg.hidden_size)

    def __call__(self, x: jax.Array, use_lora: bool, rngs: nnx.Rngs | None) -> jax.Array:
        gated = jax.nn.silu(self.gate_proj(x, use_lora, rngs)) * self.up_proj(x, use_lora, rngs)
        return self.down_proj(gated, use_lora, rngs)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, lora: LoRAConfig | None, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, lora, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, lora, dtype, rngs)

    def __call__(self, x, positions, mask, inv_freq, cache, slot, use_lora, rngs):
        attn, cache = self.self_attn(
            self.input_layernorm(x), positions, mask, inv_freq, cache, slot, use_lora, rngs
        )
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), use_lora, rngs), cache


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values plus which slots hold real tokens (prompts are left-padded)."""

    layers: tuple[LayerCache, ...]
    valid: jax.Array  # [B, S] bool


class Decoder(nnx.Module):
    """The policy: token ids -> logits, optionally through a KV cache, LoRA on or off."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        lora: LoRAConfig | None = None,
        dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.config, self.lora, self.dtype = cfg, lora, dtype
        embed = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32)
        self.embed_tokens = nnx.Param((embed * 0.02).astype(dtype))
        self.layers = nnx.List([Block(cfg, lora, dtype, rngs) for _ in range(cfg.num_layers)])
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
        mask: jax.Array,  # [B, T, S]
        cache: KVCache | None = None,
        slot: jax.Array | int = 0,
        use_lora: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        x = self.embed_tokens[...][input_ids]
        inv_freq = jnp.asarray(rope_inv_freq(self.config), jnp.float32)  # a compile-time constant
        new_layers = []
        for i, layer in enumerate(self.layers):
            layer_cache = None if cache is None else cache.layers[i]
            x, layer_cache = layer(x, positions, mask, inv_freq, layer_cache, slot, use_lora, rngs)
            new_layers.append(layer_cache)
        new_cache = None if cache is None else cache.replace(layers=tuple(new_layers))
        return self.norm(x), new_cache

    def __call__(
        self,
        input_ids: jax.Array,  # [B, T]
        positions: jax.Array | None = None,  # [B, T]; default: count of real tokens so far
        attention_mask: jax.Array | None = None,  # [B, T] 1 = real token, 0 = padding
        use_lora: bool = True,
        rngs: nnx.Rngs | None = None,  # a 'dropout' stream turns LoRA dropout on (training)
    ) -> jax.Array:  # [B, T, V]
        b, t = input_ids.shape
        valid = jnp.ones((b, t), bool) if attention_mask is None else attention_mask.astype(bool)
        if positions is None:
            positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None] & valid[:, None, :]
        hidden, _ = self.hidden_states(input_ids, positions, mask, use_lora=use_lora, rngs=rngs)
        return self.logits(hidden)

    def init_cache(self, batch: int, slots: int, dtype: jnp.dtype | None = None) -> KVCache:
        cfg = self.config
        keys = (batch, cfg.num_kv_heads, cfg.head_dim, slots)
        values = (batch, cfg.num_kv_heads, slots, cfg.head_dim)
        dtype = dtype or self.dtype
        layers = tuple(
            LayerCache(jnp.zeros(keys, dtype), jnp.zeros(values, dtype))
            for _ in range(cfg.num_layers)
        )
        return KVCache(layers, jnp.zeros((batch, slots), bool))
