"""`generate`: sample a completion for every prompt at once (docs/design.md#models).

There is one sampler, the slot pool (`slot_pool.py`): `generate` admits every request to a pool
of its own at once (prefill, in chunks when asked, then one decode call), and the continuous
engine admits requests to a long-lived pool as they come. Both compile the same bucketed shapes
(`shapes`) and a row draws the same tokens either way: token i of a row comes from
fold_in(row key, i), so a row's sample depends on its key, prompt and settings, not on which
other rows share its pass (docs/design.md#determinism). A row's temperature, top-k, top-p and token
budget are traced values: changing them recompiles nothing, except where a change turns a filter
on or off for the whole pass (greedy vs sampled, top-k or top-p in use) or moves `max_new_tokens`
to another `decode_steps` bucket.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mmgrpo_jax.sampler.shapes import cache_bucket, row_bucket, token_bucket
from mmgrpo_jax.sampler.slot_pool import DecodeRows, RowSampling, SlotPool
from mmgrpo_jax.sampler.token_sampling import fold_in_rows
from mmgrpo_jax.sampler.types import Completion
from models.config import ModelConfig
from models.decoder import Decoder
from models.sharding import batch_multiple


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
    tokens a pass. `max_cache_tokens` bounds rows x cache slots of one pool: a larger request
    batch is sampled in several pools, one after another. A model with several LoRA adapters
    (per-module adapters) needs `adapter_ids`, the adapter of each prompt; a batch may mix them.
    """
    if not prompts:
        return []
    check_arguments(prompts, model.config, max_new_tokens, temperature, top_p, top_k)
    if prefill_chunk < 0:
        raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
    adapters = check_adapter_ids(model, adapter_ids, len(prompts))
    n = len(prompts)
    if keys is None:
        keys = row_keys(seed, n)
    elif keys.shape != (n,):
        raise ValueError(f"keys has shape {keys.shape}, want one key per prompt ({n},)")
    sampling = RowSampling(
        keys=keys,
        temperature=np.full(n, max(temperature, 0.0), np.float32),
        top_k=np.full(n, top_k, np.int32),
        top_p=np.full(n, top_p, np.float32),
        adapters=np.zeros(n, np.int32) if adapters is None else adapters,
    )
    eos = tuple(sorted({int(t) for t in eos_token_ids}))
    per_call = _rows_per_call(prompts, max_new_tokens, max_cache_tokens, mesh)
    graphdef, state = nnx.split(model)
    completions: list[Completion] = []
    for start in range(0, n, per_call):
        index = np.arange(start, min(start + per_call, n))
        completions += _sample_together(
            model,
            (graphdef, (state,)),
            [prompts[i] for i in index],
            sampling.select(index),
            max_new_tokens,
            eos,
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


def decode_steps(max_new_tokens: int) -> int:
    """The steps of `generate`'s one decode call (its first token comes from the prefill):
    bucketed, so token budgets share programs; rows stop at their own budget."""
    return token_bucket(max_new_tokens - 1) if max_new_tokens > 1 else 0


def request_slots(prompt_tokens: int, max_new_tokens: int) -> int:
    """The cache slots a row of `generate`'s pool has for its longest request."""
    return cache_bucket(prompt_tokens + decode_steps(max_new_tokens))


def _rows_per_call(prompts, max_new_tokens, max_cache_tokens, mesh) -> int:
    """The most requests one pool takes within the cache budget (all without one)."""
    n = len(prompts)
    if not max_cache_tokens:
        return n
    slots = request_slots(max(map(len, prompts)), max_new_tokens)
    multiple = batch_multiple(mesh)
    fits = rows_within_budget(n, slots, max_cache_tokens, multiple)
    if not fits:
        raise ValueError(
            f"one request needs {row_bucket(1, multiple) * slots} cache slots (a prompt of "
            f"{max(map(len, prompts))} tokens + {max_new_tokens} new, bucketed), more than "
            f"max_cache_tokens={max_cache_tokens}: raise it or shorten the prompts"
        )
    return fits


def rows_within_budget(requests: int, slots: int, max_cache_tokens: int, multiple: int = 1) -> int:
    """The most of `requests` whose pool rows x `slots` stay within the budget; 0 if none."""
    fits = [
        b for b in range(1, requests + 1) if row_bucket(b, multiple) * slots <= max_cache_tokens
    ]
    return max(fits, default=0)


def _sample_together(
    model: Decoder,
    split: tuple[nnx.GraphDef, tuple[nnx.State, ...]],
    prompts: Sequence[Sequence[int]],
    sampling: RowSampling,
    max_new_tokens: int,
    eos: tuple[int, ...],
    mesh: Mesh | None,
    prefill_chunk: int,
) -> list[Completion]:
    """Every request admitted to a fresh pool at once: prompts prefilled (a chunk of the long
    ones a pass, the last pass sampling every row's first token), then one decode call."""
    n = len(prompts)
    pool = SlotPool(model, row_bucket(n), eos_token_ids=eos, mesh=mesh)
    steps = decode_steps(max_new_tokens)
    pool.ensure_slots(max(map(len, prompts)) + steps)  # once: the passes never grow it
    rows, starts = list(range(n)), [0] * n
    while prefill_chunk and (
        long := [i for i in rows if len(prompts[i]) - starts[i] > prefill_chunk]
    ):
        pool.extend(  # the first chunk of each long prompt's rest (its sample is not used)
            split,
            source_rows=long,
            rows=long,
            tokens=[prompts[i][starts[i] : starts[i] + prefill_chunk] for i in long],
            starts=[starts[i] for i in long],
            sampling=sampling.select(np.asarray(long)),
        )
        for i in long:
            starts[i] += prefill_chunk
    first, first_logprob = pool.extend(
        split,
        source_rows=rows,
        rows=rows,
        tokens=[p[s:] for p, s in zip(prompts, starts, strict=True)],
        starts=starts,
        sampling=sampling,
    )
    finished = [max_new_tokens == 1 or int(t) in eos for t in first]
    tokens = [[int(t)] for t in first]
    logprobs = [[float(lp)] for lp in first_logprob]
    if not all(finished):
        result = pool.decode(
            split,
            DecodeRows(
                rows=rows,
                last_token=[int(t) for t in first],
                filled=[len(p) for p in prompts],
                generated=[1] * n,
                max_new=[1 if done else max_new_tokens for done in finished],
                sampling=sampling,
            ),
            steps,
        )
        for i in rows:
            kept = result.tokens[i] >= 0
            tokens[i] += result.tokens[i][kept].tolist()
            logprobs[i] += result.logprobs[i][kept].tolist()
    return [
        Completion(t, lp, "stop" if t[-1] in eos else "length")
        for t, lp in zip(tokens, logprobs, strict=True)
    ]
