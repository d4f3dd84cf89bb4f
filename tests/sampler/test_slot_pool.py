import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmgrpo_jax.sampler.generate import generate, row_keys
from mmgrpo_jax.sampler.slot_pool import RowSampling, SlotPool, decode_pass, extend_pass
from mmgrpo_jax.sampler.token_sampling import RowFilters
from models.attention import AttentionConfig
from models.hf import from_pretrained
from tests.models.hf_fixtures import VOCAB

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (5, 12, 1, 20)]


def test_a_bfloat16_cache_is_stored_as_its_bits_and_written_in_place(checkpoints):
    """On uint16 bits a per-row scatter updates the cache in place; on bfloat16 XLA's CPU
    compiler widened the whole cache to float32 around it (temporaries of 2x the cache)."""
    model = from_pretrained(checkpoints["llama31"], dtype=jnp.bfloat16)
    model.attention = AttentionConfig("blockwise", q_block=16, kv_block=256)  # small scores
    pool = SlotPool(model, 8, eos_token_ids=[0])
    pool.ensure_slots(8192)
    assert pool.cache.keys.dtype == jnp.uint16 and pool.cache.values.dtype == jnp.uint16
    cache_bytes = pool.cache.keys.nbytes + pool.cache.values.nbytes
    graphdef, state = nnx.split(model)
    rows = jnp.zeros(8, jnp.int32)
    sampling = RowSampling(row_keys(0, 8), np.ones(8, np.float32), rows, np.ones(8), rows)
    filters = RowFilters(any_sampled=True, any_top_k=False, any_top_p=False)
    shared = dict(filters=filters, mesh=None)
    passes = {
        "prefill": extend_pass.lower(
            graphdef, (state,), pool.cache, None, None, jnp.zeros((8, 16), jnp.int32),
            rows, rows + 16, sampling, **shared,
        ),
        "decode": decode_pass.lower(
            graphdef, (state,), pool.cache, None, rows, rows, rows, rows, sampling,
            steps=16, eos=(0,), **shared,
        ),
    }  # fmt: skip
    for name, lowered in passes.items():
        memory = lowered.compile().memory_analysis()
        assert memory.alias_size_in_bytes == cache_bytes, name  # donated, written in place
        # (widened: 2x the cache and more; on the bits: one layer read as float32 at most)
        assert memory.temp_size_in_bytes < 2 * cache_bytes, (name, memory.temp_size_in_bytes)


def test_greedy_bfloat16_samples_follow_the_uncached_forward(checkpoints):
    """The cached passes read the stored bits back as bfloat16: every sampled token is the
    argmax of the full forward pass over the prompt and the tokens before it."""
    model = from_pretrained(checkpoints["llama31"], dtype=jnp.bfloat16)
    out = generate(model, PROMPTS, max_new_tokens=6, temperature=0)
    for prompt, completion in zip(PROMPTS, out, strict=True):
        ids = jnp.asarray([prompt + completion.token_ids])
        logits = jax.device_get(model(ids)[0].astype(jnp.float32))
        start = len(prompt) - 1
        want = logits[start : start + len(completion.token_ids)].argmax(-1)
        assert completion.token_ids == want.tolist()


def test_an_in_place_extend_leaves_the_rows_it_pads_with_alone(checkpoints):
    """Rows 5-7 of an 8-row pool hold prompts (the continuous engine's live or held rows); a
    pass over rows 0-4 is a bucket of 8 rows, the whole pool, so it runs in place with rows 5-7
    as its padding: their caches stay as they were."""
    model = from_pretrained(checkpoints["llama31"])
    pool = SlotPool(model, 8, eos_token_ids=[0])
    graphdef, state = nnx.split(model)
    split = (graphdef, (state,))
    greedy = np.zeros(8, np.int32)
    sampling = RowSampling(row_keys(0, 8), np.zeros(8, np.float32), greedy, np.ones(8), greedy)

    def extend(rows, length):
        tokens = [RNG.integers(0, VOCAB, length).tolist() for _ in rows]
        index = np.asarray(rows)
        pool.extend(
            split, source_rows=rows, rows=rows, tokens=tokens, starts=[0] * len(rows),
            sampling=sampling.select(index),
        )  # fmt: skip

    extend([5, 6, 7], 20)
    held = jax.device_get((pool.cache.keys[:, 5:], pool.cache.values[:, 5:]))
    extend([0, 1, 2, 3, 4], 9)
    np.testing.assert_array_equal(jax.device_get(pool.cache.keys[:, 5:]), held[0])
    np.testing.assert_array_equal(jax.device_get(pool.cache.values[:, 5:]), held[1])
