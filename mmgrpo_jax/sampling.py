"""The jitted sampler: prefill + a KV-cache decode loop, ragged prompts, per-row stop (DESIGN 6).

Prompts are left-padded into a [B, P] bucket so every row's last prompt token sits in slot P-1 and
decode step i writes slot P+i-1 for all rows at once; RoPE positions count real tokens only.
Prefill runs the lm_head on the last position only. The decode loop is one `lax.while_loop` that
stops when every row is done or `max_new_tokens` is reached; the cache is donated into it.
Batch, prompt and generation lengths are bucketed (`shapes.bucket`), so a run compiles a bounded
number of times; `max_new_tokens` and `temperature` are traced values and never recompile. Every
row samples from its own key (token i from fold_in(row key, i)), so a row's tokens do not depend
on which other rows share its batch (DESIGN section 9).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Literal

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mmgrpo_jax.shapes import bucket
from models.attention import AttentionMask
from models.config import ModelConfig
from models.decoder import Decoder, KVCache
from models.sharding import batch_multiple, batch_sharding, cache_sharding

MIN_LENGTH_BUCKET = 16
LENGTH_GRANULE = 512  # token lengths: powers of two up to here, then multiples of it
BATCH_GRANULE = 8  # batch sizes likewise


def length_bucket(n: int) -> int:
    """The padded length of n tokens (prompts, completions, training rows)."""
    return bucket(n, MIN_LENGTH_BUCKET, LENGTH_GRANULE)


def prompt_bucket(n: int, prefill_chunk: int = 0) -> int:
    """The padded length of an n-token prompt: a multiple of the prefill chunk when chunked."""
    length = length_bucket(n)
    if 0 < prefill_chunk < length:
        return -(-length // prefill_chunk) * prefill_chunk
    return length


def batch_bucket(n: int) -> int:
    """The padded size of a batch of n requests."""
    return bucket(n, 1, BATCH_GRANULE)


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log-softmax of logits / temperature (T=1 when greedy), full vocab
    finish_reason: Literal["stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The static part of sampling: changing it recompiles."""

    greedy: bool
    top_k: int
    top_p: float
    eos_token_ids: tuple[int, ...]


@flax.struct.dataclass
class DecodeState:
    step: jax.Array  # [] tokens generated so far
    tokens: jax.Array  # [B, N]
    logprobs: jax.Array  # [B, N]
    lengths: jax.Array  # [B]
    done: jax.Array  # [B]
    cache: KVCache
    keys: jax.Array  # [B] one per row


def _sample(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, params: SamplingParams
) -> tuple[jax.Array, jax.Array]:  # logits [B, V], one key per row -> token [B], logprob [B]
    scaled = logits.astype(jnp.float32)
    if params.greedy:
        token = jnp.argmax(scaled, axis=-1)
    else:
        scaled = scaled / temperature
        filtered = scaled
        if params.top_k > 0:
            kth = jax.lax.top_k(scaled, params.top_k)[0][:, -1:]
            filtered = jnp.where(scaled < kth, -jnp.inf, filtered)
        if params.top_p < 1.0:
            filtered = nucleus(filtered, params.top_p)
        token = jax.vmap(jax.random.categorical)(keys, filtered)
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


@dataclasses.dataclass(frozen=True)
class RowFilters:
    """Which filters some row of a mixed batch uses: static, so a batch without them skips them."""

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
    """`_sample` with every row's own settings (the continuous engine's mixed batches): a row
    draws exactly what `_sample` draws with its settings alone."""
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


def _attend_mask(valid: jax.Array, first_slot: jax.Array | int, length: int) -> AttentionMask:
    """Queries at slots first_slot + t see the filled slots up to their own."""
    slots = first_slot + jnp.arange(length, dtype=jnp.int32)
    return AttentionMask(jnp.broadcast_to(slots, (valid.shape[0], length)), valid)


@functools.partial(jax.jit, static_argnames=("graphdef", "slots", "params", "mesh", "chunk"))
def _prefill(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens: jax.Array,  # [B, P]
    valid: jax.Array,  # [B, P]
    keys: jax.Array,  # [B] one per row
    temperature: jax.Array,
    slots: int,
    params: SamplingParams,
    mesh: Mesh | None,
    chunk: int = 0,  # > 0 and dividing P: prefill that many prompt positions at a time
    adapters: jax.Array | None = None,  # [B] per-row adapter ids (several adapters)
) -> tuple[jax.Array, jax.Array, KVCache, jax.Array]:
    model: Decoder = nnx.merge(graphdef, state)
    use_lora = True if adapters is None else adapters
    batch, prompt = tokens.shape
    cache = model.init_cache(batch, slots)
    if mesh is not None:
        cache = jax.lax.with_sharding_constraint(cache, _cache_shardings(cache, mesh))
    cache = cache.replace(valid=cache.valid.at[:, :prompt].set(valid))
    positions = jnp.maximum(jnp.cumsum(valid, axis=-1) - 1, 0)
    if 0 < chunk < prompt:
        if prompt % chunk:
            raise ValueError(f"prefill chunk {chunk} does not divide the prompt bucket {prompt}")

        # Chunked prefill: the activations of `chunk` positions at a time, each chunk attending
        # to the cache filled so far (a 48 x 6,144-token prefill otherwise holds ~15 GB per MLP
        # activation at 8B).
        def prefill_chunk(cache, start):
            ids, pos = (
                jax.lax.dynamic_slice_in_dim(x, start, chunk, 1) for x in (tokens, positions)
            )
            mask = _attend_mask(cache.valid, start, chunk)
            hidden, cache = model.hidden_states(
                ids, pos, mask, cache, slot=start, use_lora=use_lora
            )
            return cache, hidden[:, -1]

        starts = jnp.arange(0, prompt, chunk, dtype=jnp.int32)
        cache, last = jax.lax.scan(prefill_chunk, cache, starts)
        last_hidden = last[-1]
    else:
        mask = _attend_mask(cache.valid, 0, prompt)
        hidden, cache = model.hidden_states(
            tokens, positions, mask, cache, slot=0, use_lora=use_lora
        )
        last_hidden = hidden[:, -1]
    logits = model.logits(last_hidden)  # last position only: [B, V]
    token, logprob = _sample(logits, fold_in_rows(keys, 0), temperature, params)
    return token, logprob, cache, positions[:, -1] + 1


def fold_in_rows(keys: jax.Array, data: jax.Array | int) -> jax.Array:
    """Every row's key folded with its data (or all with the same: the index of the token
    they draw)."""
    in_axes = (0, 0 if jnp.ndim(data) else None)
    return jax.vmap(jax.random.fold_in, in_axes=in_axes)(keys, data)


def _cache_shardings(cache: KVCache, mesh: Mesh):
    kv = cache_sharding(mesh)
    return KVCache(keys=kv, values=kv, valid=batch_sharding(mesh, 2))


@functools.partial(
    jax.jit, static_argnames=("graphdef", "params", "new_bucket"), donate_argnames=("cache",)
)
def _decode(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    first_token: jax.Array,  # [B]
    first_logprob: jax.Array,  # [B]
    cache: KVCache,
    next_position: jax.Array,  # [B] position of the first generated token
    live: jax.Array,  # [B] False for batch padding rows
    keys: jax.Array,  # [B] one per row
    temperature: jax.Array,
    max_new_tokens: jax.Array,
    params: SamplingParams,
    new_bucket: int,
    adapters: jax.Array | None = None,  # [B] per-row adapter ids (several adapters)
) -> DecodeState:
    model: Decoder = nnx.merge(graphdef, state)
    use_lora = True if adapters is None else adapters
    batch = first_token.shape[0]
    prompt_slots = cache.valid.shape[1] - new_bucket
    eos = jnp.asarray(params.eos_token_ids or (-1,), jnp.int32)
    init = DecodeState(
        step=jnp.array(1, jnp.int32),
        tokens=jnp.zeros((batch, new_bucket), jnp.int32).at[:, 0].set(first_token),
        logprobs=jnp.zeros((batch, new_bucket), jnp.float32).at[:, 0].set(first_logprob),
        lengths=jnp.ones((batch,), jnp.int32),
        done=~live | jnp.isin(first_token, eos),
        cache=cache,
        keys=keys,
    )

    def cond(s: DecodeState) -> jax.Array:
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: DecodeState) -> DecodeState:
        slot = prompt_slots + s.step - 1  # where the previous token goes
        previous = s.tokens[:, s.step - 1]
        cache = s.cache.replace(valid=s.cache.valid.at[:, slot].set(True))
        positions = (next_position + s.step - 1)[:, None]
        mask = _attend_mask(cache.valid, slot, 1)
        hidden, cache = model.hidden_states(
            previous[:, None], positions, mask, cache, slot=slot, use_lora=use_lora
        )
        logits = model.logits(hidden[:, 0])
        token, logprob = _sample(logits, fold_in_rows(s.keys, s.step), temperature, params)
        token = jnp.where(s.done, 0, token)
        logprob = jnp.where(s.done, 0.0, logprob)
        return DecodeState(
            step=s.step + 1,
            tokens=s.tokens.at[:, s.step].set(token),
            logprobs=s.logprobs.at[:, s.step].set(logprob),
            lengths=s.lengths + (~s.done).astype(jnp.int32),
            done=s.done | jnp.isin(token, eos),
            cache=cache,
            keys=s.keys,
        )

    return jax.lax.while_loop(cond, body, init)


def check_arguments(
    prompts: Sequence[Sequence[int]],
    config: ModelConfig,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
) -> None:
    """Refuse, naming the value, what the sampler cannot do right (rather than sample garbage):
    positions past the model's `max_position_embeddings` included."""
    vocab, positions = config.vocab_size, config.max_position_embeddings
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0 or top_k > vocab:
        raise ValueError(f"top_k must be in [0, {vocab}], got {top_k}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt) + max_new_tokens > positions:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} "
                f"that passes the model's max_position_embeddings={positions}"
            )


def generate(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    eos_token_ids: Sequence[int] = (),
    seed: int = 0,
    keys: jax.Array | None = None,
    adapter_ids: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    prefill_chunk: int = 0,
    max_cache_tokens: int | None = None,
) -> list[Completion]:
    """Sample a completion for every prompt; temperature 0 is greedy. See the module doc.

    `keys` ([n] PRNG keys, one per prompt) are the rows' sampling keys; without them row i
    draws from fold_in(key(seed), i). A row's sample depends on its key, prompt and settings
    only, not on the other rows. `prefill_chunk` > 0 prefills prompts longer than it that many
    tokens at a time (the prompt bucket is then a multiple of it). `max_cache_tokens` bounds
    padded rows x cache slots of one call: a larger request batch is sampled in several calls.
    A model with several LoRA adapters (per-module adapters) needs `adapter_ids`, the adapter
    of each prompt; a batch may mix them.
    """
    if not prompts:
        return []
    check_arguments(prompts, model.config, max_new_tokens, temperature, top_p, top_k)
    adapters = check_adapter_ids(model, adapter_ids, len(prompts))
    params = SamplingParams(
        greedy=temperature == 0,
        top_k=int(top_k),
        top_p=float(top_p),
        eos_token_ids=tuple(sorted({int(t) for t in eos_token_ids})),
    )
    if keys is None:
        keys = row_keys(seed, len(prompts))
    elif keys.shape != (len(prompts),):
        raise ValueError(f"keys has shape {keys.shape}, want one key per prompt ({len(prompts)},)")
    per_call = _rows_per_call(prompts, max_new_tokens, prefill_chunk, max_cache_tokens, mesh)
    completions: list[Completion] = []
    for start in range(0, len(prompts), per_call):
        part = slice(start, start + per_call)
        completions += _generate_batch(
            model,
            prompts[part],
            max_new_tokens,
            temperature,
            params,
            keys[part],
            None if adapters is None else adapters[part],
            mesh,
            prefill_chunk,
        )
    return completions


def check_adapter_ids(
    model: Decoder, adapter_ids: Sequence[int] | None, n: int
) -> np.ndarray | None:
    """The rows' adapter ids as an array, None for a model with one adapter (or none)."""
    count = 1 if model.lora is None else model.lora.num_adapters
    if adapter_ids is None:
        if count > 1:
            raise ValueError(
                f"the model has {count} LoRA adapters {list(model.lora.adapter_names)}: pass "
                "adapter_ids, one per prompt"
            )
        return None
    ids = np.asarray(adapter_ids, np.int32)
    if ids.shape != (n,):
        raise ValueError(f"adapter_ids has shape {ids.shape}, want one per prompt ({n},)")
    bad = ids[(ids < 0) | (ids >= count)]
    if bad.size:
        raise ValueError(f"adapter id {int(bad[0])} outside [0, {count}) for this model")
    return ids if count > 1 else None


def path_key(seed: int, path: Sequence[int]) -> jax.Array:
    """The key of a request named by `path`, (step, example, rollout, call) in a rollout:
    fold_in(... fold_in(key(seed), path[0]) ..., path[-1])."""
    if seed < 0 or any(x < 0 for x in path):
        raise ValueError(f"a key path and its seed must be >= 0, got seed {seed}, path {path}")
    return _path_key(jnp.asarray(seed, jnp.uint32), jnp.asarray(path, jnp.uint32))


@jax.jit
def _path_key(seed: jax.Array, path: jax.Array) -> jax.Array:
    return jax.lax.fori_loop(
        0, path.shape[0], lambda i, k: jax.random.fold_in(k, path[i]), jax.random.key(seed)
    )


def row_keys(seed: int, n: int) -> jax.Array:
    """[n] keys: fold_in(key(seed), i) for row i."""
    return fold_in_rows(jnp.broadcast_to(jax.random.key(seed), (n,)), jnp.arange(n))


def _rows_per_call(prompts, max_new_tokens, prefill_chunk, max_cache_tokens, mesh) -> int:
    """The most requests one sampler call takes within the cache budget (all without one)."""
    n = len(prompts)
    if not max_cache_tokens:
        return n
    slots = prompt_bucket(max(map(len, prompts)), prefill_chunk) + length_bucket(max_new_tokens)
    multiple = batch_multiple(mesh)
    fits = rows_within_budget(n, slots, max_cache_tokens, multiple)
    if not fits:
        raise ValueError(
            f"one request needs {_padded_batch(1, multiple) * slots} cache slots (a prompt of "
            f"{max(map(len, prompts))} tokens + {max_new_tokens} new, bucketed), more than "
            f"max_cache_tokens={max_cache_tokens}: raise it or shorten the prompts"
        )
    return fits


def rows_within_budget(requests: int, slots: int, max_cache_tokens: int, multiple: int = 1) -> int:
    """The most of `requests` whose padded batch x `slots` stays within the budget; 0 if none."""
    fits = [
        b for b in range(1, requests + 1) if _padded_batch(b, multiple) * slots <= max_cache_tokens
    ]
    return max(fits, default=0)


def _padded_batch(n: int, multiple: int) -> int:
    return -(-batch_bucket(n) // multiple) * multiple


def _generate_batch(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    params: SamplingParams,
    keys: jax.Array,  # [n]
    adapters: np.ndarray | None,  # [n] adapter ids; None: the model's one adapter (or none)
    mesh: Mesh | None,
    prefill_chunk: int,
) -> list[Completion]:
    n = len(prompts)
    batch = _padded_batch(n, batch_multiple(mesh))
    prompt_len = prompt_bucket(max(len(p) for p in prompts), prefill_chunk)
    new_bucket = length_bucket(max_new_tokens)
    tokens = np.zeros((batch, prompt_len), np.int32)
    valid = np.zeros((batch, prompt_len), bool)
    for i, prompt in enumerate(prompts):
        tokens[i, prompt_len - len(prompt) :] = prompt
        valid[i, prompt_len - len(prompt) :] = True
    valid[n:, -1] = True  # batch padding rows: one dummy token, never reported
    live = np.arange(batch) < n
    # batch padding rows draw (and discard) from copies of the first row's key
    keys = jnp.concatenate([keys, jnp.broadcast_to(keys[0], (batch - n,))])
    if adapters is not None:  # padding rows: adapter 0
        adapters = np.concatenate([adapters, np.zeros(batch - n, np.int32)])
        if mesh is not None:
            adapters = jax.device_put(adapters, batch_sharding(mesh, 1))
    if mesh is not None:
        tokens, valid, live, keys = (
            jax.device_put(a, batch_sharding(mesh, a.ndim)) for a in (tokens, valid, live, keys)
        )
    temp = jnp.asarray(temperature if temperature > 0 else 1.0, jnp.float32)
    graphdef, state = nnx.split(model)
    first, first_logprob, cache, next_position = _prefill(
        graphdef,
        state,
        tokens,
        valid,
        keys,
        temp,
        prompt_len + new_bucket,
        params,
        mesh,
        prefill_chunk,
        adapters,
    )
    final = _decode(
        graphdef,
        state,
        first,
        first_logprob,
        cache,
        next_position,
        jnp.asarray(live),
        keys,
        temp,
        jnp.asarray(max_new_tokens, jnp.int32),
        params,
        new_bucket,
        adapters,
    )
    out_tokens, out_logprobs, lengths = jax.device_get(
        (final.tokens, final.logprobs, final.lengths)
    )
    eos = set(params.eos_token_ids)
    completions = []
    for i in range(n):
        ids = out_tokens[i, : lengths[i]].tolist()
        stopped = bool(ids) and ids[-1] in eos
        completions.append(
            Completion(ids, out_logprobs[i, : lengths[i]].tolist(), "stop" if stopped else "length")
        )
    return completions
