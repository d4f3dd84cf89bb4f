import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import (
    AttentionConfig,
    AttentionMask,
    attend,
    blockwise_attention,
    dense_attention,
)

B, K, G, T, DH = 2, 2, 3, 37, 8


def qkv(dtype, t=T, s=T, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, K, t, G, DH))
    keys = rng.normal(size=(B, K, DH, s))
    values = rng.normal(size=(B, K, s, DH))
    return tuple(jnp.asarray(x, dtype) for x in (q, keys, values))


def masks():
    """Right padding, left padding, packed segments, and a cached prefill's offset queries."""
    right = np.arange(T)[None] < np.array([[T], [20]])
    left = np.arange(T)[None] >= np.array([[0], [6]])
    segments = np.zeros((B, T), np.int32)
    segments[0, 12:], segments[1, 5:], segments[1, 30:] = 1, 1, 2
    offset = AttentionMask(
        jnp.broadcast_to(jnp.arange(10, 10 + T, dtype=jnp.int32), (B, T)),
        jnp.asarray(np.arange(T + 16)[None] >= np.array([[0], [3]])),
    )
    # prefix trees, laid out depth first; a token's reach is the slot after the rows sharing it.
    # Row 0: prompt P (slots 0-9) with two completions (10-17, 18-25), then prompt Q (26-31)
    # with one (32-36). Row 1, three levels: an instruction (0-7) shared by two prompts, A's
    # tail (8-14) with completions 15-19 and 20-24, B's tail (25-30) with completion 31-36.
    reach = np.full((B, T), T, np.int32)
    reach[0, :10], reach[0, 10:18], reach[0, 18:26] = 26, 18, 26
    reach[1, 8:15], reach[1, 15:20], reach[1, 20:25] = 25, 20, 25
    return {
        "prefix_tree": AttentionMask.causal(jnp.ones((B, T), bool), None, jnp.asarray(reach)),
        "right_padded": AttentionMask.causal(jnp.asarray(right)),
        "left_padded": AttentionMask.causal(jnp.asarray(left)),
        "packed": AttentionMask.causal(jnp.ones((B, T), bool), jnp.asarray(segments)),
        "offset_queries": offset,
    }


def loss_and_grads(fn, q, keys, values, mask):
    seen = np.asarray(mask.dense().any(-1))[:, None, :, None, None]  # queries that see a slot

    def loss(q, keys, values):
        out = fn(q, keys, values).astype(jnp.float32)
        return jnp.sum(jnp.where(seen, jnp.sin(out) * out, 0.0))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, keys, values)


def assert_close(got, want, rel):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = max(np.abs(want).max(), 1e-6)
    assert np.abs(got - want).max() <= rel * scale, np.abs(got - want).max() / scale


# float32: the tiles only reorder sums. bf16: the tiles keep scores and sums in float32 where the
# reference rounds the scores to bf16 first, so they differ by a few bf16 ulps of the outputs.
FLOAT32, BFLOAT16 = (jnp.float32, 2e-5), (jnp.bfloat16, 4e-2)
CASES = [(*dtype, name, (8, 16)) for dtype in (FLOAT32, BFLOAT16) for name in sorted(masks())]
CASES += [(*FLOAT32, "packed", (5, 7)), (*FLOAT32, "left_padded", (64, 64))]  # ragged; one tile


@pytest.mark.parametrize(("dtype", "rel", "name", "blocks"), CASES)
def test_blockwise_equals_dense_outputs_and_gradients(dtype, rel, name, blocks):
    mask = masks()[name]
    q, keys, values = qkv(dtype, s=mask.kv_valid.shape[1])
    want = loss_and_grads(lambda *a: dense_attention(*a, mask), q, keys, values, mask)
    got = loss_and_grads(lambda *a: blockwise_attention(*a, mask, *blocks), q, keys, values, mask)
    assert_close(got[0], want[0], rel)
    for g, w in zip(got[1], want[1], strict=True):
        assert g.dtype == w.dtype
        assert_close(g, w, rel)


def test_a_prefix_trees_token_sees_its_own_rows_earlier_tokens_only():
    allowed = np.asarray(masks()["prefix_tree"].dense())
    second = allowed[0, 20]  # a token of prompt P's second completion
    assert np.flatnonzero(second).tolist() == [*range(10), *range(18, 21)]
    assert np.flatnonzero(allowed[0, 34]).tolist() == [*range(26, 35)]  # Q's: Q and itself
    assert np.flatnonzero(allowed[0, 5]).tolist() == [*range(6)]  # prompt tokens: causal
    # three levels: B's completion sees the instruction, B's tail and itself, not A's subtree
    assert np.flatnonzero(allowed[1, 33]).tolist() == [*range(8), *range(25, 34)]
    assert np.flatnonzero(allowed[1, 22]).tolist() == [*range(15), *range(20, 23)]


def test_pallas_refuses_a_prefix_tree_mask():
    mask = masks()["prefix_tree"]
    with pytest.raises(ValueError, match="not a packed prefix tree's reach"):
        attend(*qkv(jnp.float32), mask, AttentionConfig("pallas", q_block=8, kv_block=8))


def test_a_query_that_sees_nothing_gets_zeros_and_no_nan():
    mask = masks()["left_padded"]  # row 1's first six queries see no slot
    q, keys, values = qkv(jnp.float32)
    out = blockwise_attention(q, keys, values, mask, 8, 8)
    np.testing.assert_array_equal(np.asarray(out[1, :, :6]), 0.0)
    grads = jax.grad(lambda q: blockwise_attention(q, keys, values, mask, 8, 8).sum())(q)
    assert np.isfinite(np.asarray(grads)).all()


def test_later_key_blocks_are_skipped_not_just_masked():
    """A prefill over a cache whose tail slots hold garbage: they are never read."""
    q, keys, values = qkv(jnp.float32, s=T + 27)
    mask = AttentionMask.causal(jnp.ones((B, T), bool)).replace(
        kv_valid=jnp.ones((B, T + 27), bool)
    )
    nan_tail = keys.at[..., T + 3 :].set(jnp.nan), values.at[:, :, T + 3 :].set(jnp.nan)
    out = blockwise_attention(q, *nan_tail, mask, 8, 8)
    prompt_only = mask.replace(kv_valid=mask.kv_valid[:, :T])  # the slots a prefill filled
    want = dense_attention(q, keys[..., :T], values[:, :, :T], prompt_only)
    assert_close(out, want, 2e-5)


def test_single_token_queries_attend_densely_whatever_the_setting():
    mask = AttentionMask(jnp.full((B, 1), T - 1, jnp.int32), jnp.ones((B, T), bool))
    q, keys, values = qkv(jnp.float32, t=1)
    got = attend(q, keys, values, mask, AttentionConfig("blockwise", 8, 8))
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(dense_attention(q, keys, values, mask))
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"implementation": "flash"}, "'flash' is not one of"), ({"q_block": 0}, "q_block must be")],
)
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionConfig(**kwargs)


@pytest.mark.parametrize("name", ["right_padded", "packed"])
def test_pallas_kernel_equals_dense_on_the_tokens_it_serves(name):
    """The fused kernel (run by the Pallas interpreter here; Triton on a GPU) against the dense
    reference: outputs and gradients of the real tokens' queries, float32."""
    t = 32  # a multiple of the kernel's tiles
    q, keys, values = qkv(jnp.float32, t=t, s=t, seed=3)
    valid = np.arange(t)[None] < np.array([[t], [21]])
    segments = np.zeros((B, t), np.int32)
    segments[0, 12:], segments[1, 5:], segments[1, 25:] = 1, 1, 2
    mask = {
        "right_padded": AttentionMask.causal(jnp.asarray(valid)),
        "packed": AttentionMask.causal(jnp.ones((B, t), bool), jnp.asarray(segments)),
    }[name]
    served = np.asarray(mask.kv_valid)[:, None, :, None, None]

    def loss_and_grads_of(fn):
        def loss(q, keys, values):
            out = fn(q, keys, values)
            return jnp.sum(jnp.where(served, jnp.sin(out) * out, 0.0)), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, keys, values)

    pallas = AttentionConfig("pallas", q_block=16, kv_block=16)
    (got_loss, got_out), got = loss_and_grads_of(lambda *x: attend(*x, mask, pallas))
    (want_loss, want_out), want = loss_and_grads_of(lambda *x: dense_attention(*x, mask))
    assert_close(np.where(served, got_out, 0), np.where(served, want_out, 0), 1e-5)
    assert_close(got_loss, want_loss, 1e-5)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, 1e-5)


def test_pallas_serves_passes_without_a_cache_only():
    q, keys, values = qkv(jnp.float32, t=16, s=40)
    slots = jnp.broadcast_to(jnp.arange(10, 26, dtype=jnp.int32), (B, 16))
    mask = AttentionMask(slots, jnp.ones((B, 40), bool))
    pallas = AttentionConfig("pallas", q_block=16, kv_block=16)
    blockwise = AttentionConfig("blockwise", q_block=16, kv_block=16)
    # a cache's slots go blockwise; without the flag the kernel refuses keys that are not the
    # queries' own tokens
    np.testing.assert_array_equal(
        attend(q, keys, values, mask, pallas, cached=True),
        attend(q, keys, values, mask, blockwise, cached=True),
    )
    with pytest.raises(ValueError, match="self-attention: 16 queries but 40 keys"):
        attend(q, keys, values, mask, pallas)
