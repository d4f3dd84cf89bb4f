"""The sampler's device side: a pool of KV-cache rows and two jitted passes over it
(docs/design.md#models and #engine). It is the only sampler: the continuous engine admits
requests to a long-lived pool as they come, and `generate` admits a whole batch at once
to a pool of its own.

Row r of the pool holds one sequence from slot 0 on: its prompt (the first part possibly copied
from another row that holds the same prefix), then its sampled tokens; RoPE positions are slots.
The pool's length grows in granules of `shapes.CACHE_GRANULE` slots with the longest request it
has held.

`extend` gathers the rows it prefills (from their prefix's donor row, or their own), writes each
prompt's tokens after its shared part (at most a chunk at a time: the caller splits longer ones),
samples every row's first token and scatters the rows back; a pass over every row of the pool, in
order, works in place. `decode` runs up to `steps` tokens for a bucket of rows holding the live
ones (gathered and scattered back), or for the whole pool in place when the bucket is the pool,
the cache donated. Every row has its own sampling settings and key (token i from
fold_in(key, i)), so a row's tokens depend on neither its neighbours nor the moment it was
scheduled. Shapes are bucketed (`shapes`: rows and tokens of a pass, the pool's length), so a
long run compiles a bounded number of programs; `traces` counts this pool's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mmgrpo_jax.sampler.shapes import cache_bucket, row_bucket, token_bucket
from mmgrpo_jax.sampler.token_sampling import RowFilters, fold_in_rows, sample_rows
from models.attention import AttentionMask
from models.decoder import Decoder, KVCache
from models.sharding import batch_multiple, cache_sharding


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Host-side settings of the rows of one pass, in pass order."""

    keys: jax.Array  # [n] PRNG keys
    temperature: np.ndarray  # [n] float32, 0 = greedy
    top_k: np.ndarray  # [n] int32, 0 = off
    top_p: np.ndarray  # [n] float32, 1 = off
    adapters: np.ndarray  # [n] int32 LoRA adapter ids (read by models with several adapters)

    @property
    def filters(self) -> RowFilters:
        return RowFilters(
            any_sampled=bool((self.temperature > 0).any()),
            any_top_k=bool(((self.top_k > 0) & (self.temperature > 0)).any()),
            any_top_p=bool(((self.top_p < 1) & (self.temperature > 0)).any()),
        )

    def select(self, index: np.ndarray) -> RowSampling:
        """Row i of the result has row index[i]'s settings: a subset, or padding rows that
        copy a real row's (their samples are dropped)."""
        return RowSampling(
            self.keys[index],
            self.temperature[index],
            self.top_k[index],
            self.top_p[index],
            self.adapters[index],
        )

    def padded(self, n: int) -> RowSampling:
        """n rows: padding rows copy the first row's settings."""
        index = np.zeros(n, np.int64)
        index[: len(self.temperature)] = np.arange(len(self.temperature))
        return self.select(index)


@dataclasses.dataclass(frozen=True)
class DecodeRows:
    """What `decode` needs of each live row, in pass order."""

    rows: Sequence[int]  # pool rows
    last_token: Sequence[int]  # sampled, not yet in the cache
    filled: Sequence[int]  # slots holding the row's tokens (the last token goes to this slot)
    generated: Sequence[int]  # tokens sampled so far (the next one's key index)
    max_new: Sequence[int]
    sampling: RowSampling


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    tokens: np.ndarray  # [n, steps] new tokens, -1 after a row finished
    logprobs: np.ndarray  # [n, steps]
    width: int  # rows the pass computed (a bucket of the live rows, or the whole pool)


class SlotPool:
    """`rows` cache rows of `slots` slots each (grown in granules of `CACHE_GRANULE` on demand)."""

    def __init__(
        self,
        model: Decoder,
        rows: int,
        *,
        eos_token_ids: Sequence[int],
        max_cache_tokens: int | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        """On a `mesh`, rows (of the pool and of every pass) split over its data x fsdp
        devices and key/value heads over tensor (`models.sharding.cache_sharding`): the pool's
        rows round up to a multiple of those devices."""
        if rows < 1:
            raise ValueError(f"a slot pool needs >= 1 rows, got {rows}")
        if max_cache_tokens is not None and max_cache_tokens < 1:
            raise ValueError(f"max_cache_tokens must be >= 1 or None, got {max_cache_tokens}")
        self.multiple = batch_multiple(mesh)
        rows = -(-rows // self.multiple) * self.multiple
        self.rows, self.max_cache_tokens, self.mesh = rows, max_cache_tokens, mesh
        self.eos = tuple(sorted({int(t) for t in eos_token_ids})) or (-1,)
        self._model = model
        self.slots = 0
        self.cache: KVCache | None = None
        self.traces = 0  # programs this pool's passes compiled

    # -- capacity ----------------------------------------------------------------------------
    def ensure_slots(self, needed: int) -> None:
        """Grow every row to hold `needed` slots (existing rows keep their contents)."""
        if needed <= self.slots and self.cache is not None:
            return
        slots = cache_bucket(needed)
        if self.max_cache_tokens is not None and self.rows * slots > self.max_cache_tokens:
            raise ValueError(
                f"a request needs {needed} cache slots; {self.rows} rows x {slots} slots exceed "
                f"max_cache_tokens={self.max_cache_tokens}: raise it, lower the slots, or shorten "
                "the prompts"
            )
        where = None if self.mesh is None else cache_sharding(self.mesh)
        fresh = self._model.init_cache(self.rows, slots, device=where)
        self.cache = fresh if self.cache is None else _grown(self.cache, fresh)
        self.slots = slots

    def reset(self) -> None:
        """Forget every row (after a failed pass, whose donated cache may be gone)."""
        self.cache, self.slots = None, 0

    # -- the passes ----------------------------------------------------------------------------
    def extend(
        self,
        model: tuple[nnx.GraphDef, tuple[nnx.State, ...]],
        *,
        source_rows: Sequence[int],
        rows: Sequence[int],
        tokens: Sequence[Sequence[int]],
        starts: Sequence[int],
        sampling: RowSampling,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Write each row's `tokens` at slots start..., on top of its source row's first
        `start` slots, and sample its first token: (tokens [n], logprobs [n]). A pass whose rows
        are the pool's first rows in order, their own sources, and whose row bucket is the pool
        runs in place (no copy of the cache); its padding rows leave their rows' slots alone."""
        n = len(rows)
        padded = row_bucket(n, self.multiple)
        width = token_bucket(max(map(len, tokens)))
        ids = np.zeros((padded, width), np.int32)
        for i, row_tokens in enumerate(tokens):
            ids[i, : len(row_tokens)] = row_tokens
        lengths = np.ones(padded, np.int32)
        lengths[:n] = [len(t) for t in tokens]
        self.ensure_slots(max(s + len(t) for s, t in zip(starts, tokens, strict=True)))
        # padding rows write past the pool's slots, where writes drop: in place, a padding row
        # is a pool row that may hold another request's cache
        start = np.full(padded, self.slots, np.int32)
        start[:n] = starts
        everyone = list(range(self.rows))
        in_place = padded == self.rows and list(rows) + everyone[n:] == everyone
        in_place = in_place and list(source_rows) == list(rows)
        graphdef, states = model
        self.cache, token, logprob = self._compiling(
            extend_pass,
            graphdef,
            states,
            self.cache,
            None if in_place else self._pad_rows(source_rows, padded),
            None if in_place else self._pad_rows(rows, padded),
            ids,
            start,
            lengths,
            sampling.padded(padded),
            filters=sampling.filters,
            mesh=self.mesh,
        )
        token, logprob = jax.device_get((token, logprob))
        return token[:n], logprob[:n]

    def decode(
        self, model: tuple[nnx.GraphDef, tuple[nnx.State, ...]], live: DecodeRows, steps: int
    ) -> DecodeResult:
        """Sample up to `steps` more tokens for every live row (fewer once all have finished).

        The pass computes a bucket of rows (`shapes.row_bucket`) that holds the live ones (8 live
        requests cost ~8 rows, not the pool's): those rows are gathered from the pool, decoded
        and scattered back, the cache donated. When the bucket is the whole pool it decodes in
        place, idle rows computing and discarding. On SmolLM2-135M a row's decode step is its
        ~135M multiply-adds (the lm_head alone 28M), far more than copying its cache row.
        """
        n = len(live.rows)
        self.ensure_slots(max(live.filled) + steps)
        rows = np.asarray(live.rows)
        width = min(row_bucket(n, self.multiple), self.rows)
        if width < self.rows:  # live rows first, then idle rows as padding (distinct rows)
            idle = np.setdiff1d(np.arange(self.rows), rows)[: width - n]
            pass_rows, at = np.concatenate([rows, idle]).astype(np.int32), np.arange(n)
        else:
            pass_rows, at = None, rows

        def spread(values, fill):
            out = np.full(width, fill, np.int32)
            out[at] = values
            return out

        index = np.zeros(width, np.int64)  # idle rows: the first live row's settings
        index[at] = np.arange(n)
        graphdef, states = model
        self.cache, tokens, logprobs = self._compiling(
            decode_pass,
            graphdef,
            states,
            self.cache,
            pass_rows,
            spread(live.last_token, 0),
            spread(live.filled, self.slots),  # idle rows write past the pool: dropped
            spread(live.generated, 0),
            spread(live.max_new, 0),  # idle rows start finished
            live.sampling.select(index),
            filters=live.sampling.filters,
            mesh=self.mesh,
            steps=steps,
            eos=self.eos,
        )
        tokens, logprobs = jax.device_get((tokens, logprobs))
        return DecodeResult(tokens[at], logprobs[at], width)

    def _compiling(self, jitted, *args, **kwargs):
        """Call a pass, counting the programs it compiled (the jit caches are shared by every
        pool in the process, so a test's or a run's later engines reuse them)."""
        before = jitted._cache_size()
        out = jitted(*args, **kwargs)
        self.traces += jitted._cache_size() - before
        return out

    def _pad_rows(self, rows: Sequence[int], n: int) -> np.ndarray:
        out = np.full(n, self.rows, np.int32)  # past the pool: reads clamp, writes drop
        out[: len(rows)] = rows
        return out


@jax.jit
def _grown(old: KVCache, fresh: KVCache) -> KVCache:
    return KVCache(
        jax.lax.dynamic_update_slice(fresh.keys, old.keys, (0,) * 5),
        jax.lax.dynamic_update_slice(fresh.values, old.values, (0,) * 5),
    )


def _gather(cache: KVCache, rows: jax.Array, mesh: Mesh | None) -> KVCache:
    part = KVCache(
        jnp.take(cache.keys, rows, axis=1, mode="clip"),
        jnp.take(cache.values, rows, axis=1, mode="clip"),
    )
    if mesh is None:
        return part
    kv = cache_sharding(mesh)
    return jax.lax.with_sharding_constraint(part, KVCache(kv, kv))


def _scatter(cache: KVCache, rows: jax.Array, part: KVCache) -> KVCache:
    return KVCache(
        cache.keys.at[:, rows].set(part.keys, mode="drop"),
        cache.values.at[:, rows].set(part.values, mode="drop"),
    )


def _row_sample(logits, keys, index, sampling: RowSampling, filters: RowFilters):
    return sample_rows(
        logits,
        fold_in_rows(keys, index),
        jnp.asarray(sampling.temperature, jnp.float32),
        jnp.asarray(sampling.top_k, jnp.int32),
        jnp.asarray(sampling.top_p, jnp.float32),
        filters,
    )


jax.tree_util.register_dataclass(
    RowSampling,
    data_fields=["keys", "temperature", "top_k", "top_p", "adapters"],
    meta_fields=[],
)


def _use_lora(model: Decoder, sampling: RowSampling) -> jax.Array | bool:
    """The rows' adapter ids for a model with several adapters, else True."""
    several = model.lora is not None and model.lora.num_adapters > 1
    return jnp.asarray(sampling.adapters, jnp.int32) if several else True


def _extend(
    graphdef: nnx.GraphDef,
    states: tuple[nnx.State, ...],  # merged with graphdef: the model
    cache: KVCache,
    source_rows: jax.Array | None,  # [n]; None (with rows): the whole pool, in place
    rows: jax.Array | None,  # [n]
    tokens: jax.Array,  # [n, T] right-padded
    starts: jax.Array,  # [n] first slot written
    lengths: jax.Array,  # [n] real tokens of each row
    sampling: RowSampling,
    *,
    filters: RowFilters,
    mesh: Mesh | None,
) -> tuple[KVCache, jax.Array, jax.Array]:
    model: Decoder = nnx.merge(graphdef, *states)
    n, width = tokens.shape
    part = cache if rows is None else _gather(cache, source_rows, mesh)
    offsets = jnp.arange(width, dtype=jnp.int32)
    positions = starts[:, None] + offsets
    queries = jnp.where(offsets < lengths[:, None], positions, -1)  # padding sees nothing
    mask = AttentionMask(queries, jnp.ones((n, cache.keys.shape[-1]), bool))
    hidden, part = model.hidden_states(
        tokens, positions, mask, part, slot=starts, use_lora=_use_lora(model, sampling)
    )
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    token, logprob = _row_sample(model.logits(last), sampling.keys, 0, sampling, filters)
    return (part if rows is None else _scatter(cache, rows, part)), token, logprob


def _decode(
    graphdef: nnx.GraphDef,
    states: tuple[nnx.State, ...],  # merged with graphdef: the model
    pool: KVCache,  # the whole pool, updated in place
    pass_rows: jax.Array | None,  # [R] pool rows this pass computes; None: all, in place
    last_token: jax.Array,  # [R]
    filled: jax.Array,  # [R]
    generated: jax.Array,  # [R]
    max_new: jax.Array,  # [R] 0 for idle rows
    sampling: RowSampling,
    *,
    filters: RowFilters,
    mesh: Mesh | None,
    steps: int,
    eos: tuple[int, ...],
) -> tuple[KVCache, jax.Array, jax.Array]:
    model: Decoder = nnx.merge(graphdef, *states)
    cache = pool if pass_rows is None else _gather(pool, pass_rows, mesh)
    rows, slots = cache.keys.shape[1], cache.keys.shape[-1]
    stop = jnp.asarray(eos, jnp.int32)
    use_lora = _use_lora(model, sampling)
    all_slots = jnp.ones((rows, slots), bool)
    if mesh is not None:
        kv = cache_sharding(mesh)
        cache = jax.lax.with_sharding_constraint(cache, KVCache(kv, kv))

    def cond(carry):
        step, _, _, _, _, done, _, _ = carry
        return (step < steps) & ~jnp.all(done)

    def body(carry):
        step, cache, previous, filled, generated, done, tokens, logprobs = carry
        # a row finished in this call rewrites its last token's own slot (the token's true cache);
        # idle rows sit past the pool, so their writes drop
        mask = AttentionMask(filled[:, None], all_slots)
        hidden, cache = model.hidden_states(
            previous[:, None], filled[:, None], mask, cache, slot=filled, use_lora=use_lora
        )
        token, logprob = _row_sample(
            model.logits(hidden[:, 0]), sampling.keys, generated, sampling, filters
        )
        live = ~done
        step_live = live.astype(jnp.int32)
        generated = generated + step_live
        return (
            step + 1,
            cache,
            jnp.where(live, token, previous),
            filled + step_live,
            generated,
            done | (live & (jnp.isin(token, stop) | (generated >= max_new))),
            tokens.at[:, step].set(jnp.where(live, token, -1)),
            logprobs.at[:, step].set(jnp.where(live, logprob, 0.0)),
        )

    init = (
        jnp.array(0, jnp.int32),
        cache,
        last_token,
        filled,
        generated,
        generated >= max_new,
        jnp.full((rows, steps), -1, jnp.int32),
        jnp.zeros((rows, steps), jnp.float32),
    )
    _, cache, *_, tokens, logprobs = jax.lax.while_loop(cond, body, init)
    if pass_rows is not None:
        cache = _scatter(pool, pass_rows, cache)
    return cache, tokens, logprobs


# the jitted passes (public for `mmgrpo plan`, which compiles them on abstract inputs)
extend_pass = jax.jit(
    _extend, static_argnames=("graphdef", "filters", "mesh"), donate_argnames="cache"
)
decode_pass = jax.jit(
    _decode,
    static_argnames=("graphdef", "filters", "mesh", "steps", "eos"),
    donate_argnames="pool",
)
