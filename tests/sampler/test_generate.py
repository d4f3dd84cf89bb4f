import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from mmgrpo_jax.sampler import generate as sampling
from mmgrpo_jax.sampler import slot_pool
from mmgrpo_jax.sampler.generate import generate
from mmgrpo_jax.sampler.shapes import bucket
from models.attention import AttentionConfig
from models.config import ModelConfig
from models.decoder import Decoder
from models.hf import from_pretrained
from tests.models.hf_fixtures import VOCAB, load_hf

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(0, VOCAB, n).tolist() for n in (5, 12, 1, 20)]


@pytest.fixture(scope="module", params=["llama31", "qwen2_bias"])
def pair(request, checkpoints):
    directory = checkpoints[request.param]
    return from_pretrained(directory, dtype=jnp.float32), load_hf(directory)


@pytest.fixture(scope="module")
def model(checkpoints):
    return from_pretrained(checkpoints["llama31"], dtype=jnp.float32)


@nnx.jit
def forward(model, ids, mask):
    return model(ids, attention_mask=mask)


def left_padded(sequences):
    width = max(len(s) for s in sequences)
    ids = np.array([[0] * (width - len(s)) + s for s in sequences])
    mask = np.array([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
    return jnp.asarray(ids), jnp.asarray(mask)


def hf_greedy(hf, prompts, max_new_tokens):
    """HF generate on the left-padded batch: tokens and log-softmax of the raw logits."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[:, width:].numpy()
    logps = torch.stack(out.logits, 1).float().log_softmax(-1).numpy()
    return tokens, np.take_along_axis(logps, tokens[..., None], -1)[..., 0]


def test_greedy_ragged_batch_equals_single_prompts_and_hf(pair):
    model, hf = pair
    batch = generate(model, PROMPTS, max_new_tokens=10, temperature=0)
    singles = [generate(model, [p], max_new_tokens=10, temperature=0)[0] for p in PROMPTS]
    want_tokens, want_logps = hf_greedy(hf, PROMPTS, 10)
    for i, (b, s) in enumerate(zip(batch, singles, strict=True)):
        assert b.token_ids == s.token_ids == want_tokens[i].tolist()
        assert b.finish_reason == "length" and len(b.logprobs) == 10
        np.testing.assert_allclose(b.logprobs, want_logps[i], atol=1e-4)
        np.testing.assert_allclose(b.logprobs, s.logprobs, atol=1e-5)


@pytest.mark.parametrize("attention", ["blockwise"])
def test_chunked_prefill_and_blockwise_attention_give_the_same_samples(model, attention):
    """Prefill 8 tokens at a time (prompts up to 40 tokens: 5 chunks; short rows in the last)."""
    prompts = [RNG.integers(0, VOCAB, n).tolist() for n in (40, 3, 17)]
    want = generate(model, prompts, max_new_tokens=6, temperature=0.8, seed=3)
    model.attention = AttentionConfig(attention, q_block=4, kv_block=8)
    try:
        got = generate(model, prompts, max_new_tokens=6, temperature=0.8, seed=3, prefill_chunk=8)
    finally:
        model.attention = AttentionConfig()
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def test_a_chunk_pass_over_the_first_rows_leaves_a_later_rows_prompt_alone(model):
    """Lengths 40, 40, 40, 12 in chunks of 8: the second pass prefills rows 0-2 only, a bucket of
    4 rows that is the whole pool, so it runs in place with row 3 as its padding; row 3 already
    holds 8 prompt tokens, which that padding must not overwrite."""
    prompts = [RNG.integers(0, VOCAB, n).tolist() for n in (40, 40, 40, 12)]
    want = generate(model, prompts, max_new_tokens=6, temperature=0.8, seed=3)
    got = generate(model, prompts, max_new_tokens=6, temperature=0.8, seed=3, prefill_chunk=8)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)


def test_max_new_tokens_one(pair):
    model, hf = pair
    out = generate(model, PROMPTS, max_new_tokens=1, temperature=0)
    want, _ = hf_greedy(hf, PROMPTS, 1)
    assert [c.token_ids for c in out] == want.tolist()
    assert {c.finish_reason for c in out} == {"length"}
    stop = generate(model, PROMPTS[:1], max_new_tokens=1, temperature=0, eos_token_ids=want[0])
    assert stop[0].finish_reason == "stop" and stop[0].token_ids == want[0].tolist()


def test_eos_stops_one_row_while_others_continue(model):
    free = generate(model, PROMPTS, max_new_tokens=12, temperature=0)
    eos = free[0].token_ids[3]
    stopped_at = free[0].token_ids.index(eos)
    out = generate(model, PROMPTS, max_new_tokens=12, temperature=0, eos_token_ids=[eos])
    assert out[0].token_ids == free[0].token_ids[: stopped_at + 1]
    assert out[0].finish_reason == "stop" and len(out[0].logprobs) == stopped_at + 1
    for got, want in zip(out[1:], free[1:], strict=True):
        if eos in want.token_ids:
            cut = want.token_ids.index(eos) + 1
            assert (got.token_ids, got.finish_reason) == (want.token_ids[:cut], "stop")
        else:
            assert (got.token_ids, got.finish_reason) == (want.token_ids, "length")
    assert any(c.finish_reason == "length" for c in out)  # some row really continued


def test_sampled_logprobs_equal_a_teacher_forced_forward(model):
    temperature = 0.7
    out = generate(model, PROMPTS, max_new_tokens=9, temperature=temperature, seed=3)
    ids, mask = left_padded([p + c.token_ids for p, c in zip(PROMPTS, out, strict=True)])
    all_logits = np.asarray(forward(model, ids, mask))
    for row, completion in enumerate(out):
        n = len(completion.token_ids)
        logits = all_logits[row, -n - 1 : -1] / temperature  # positions predicting the completion
        logps = np.asarray(jax.nn.log_softmax(logits, -1))
        want = np.take_along_axis(logps, np.array(completion.token_ids)[:, None], 1)[:, 0]
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-4)


def test_seeds_reproduce_and_differ_and_filters_narrow(model):
    a = generate(model, PROMPTS, max_new_tokens=8, seed=1)
    b = generate(model, PROMPTS, max_new_tokens=8, seed=1)
    c = generate(model, PROMPTS, max_new_tokens=8, seed=2)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    greedy = [x.token_ids for x in generate(model, PROMPTS, max_new_tokens=8, temperature=0)]
    top1 = generate(model, PROMPTS, max_new_tokens=8, top_k=1, seed=5)
    tiny_p = generate(model, PROMPTS, max_new_tokens=8, top_p=1e-6, seed=6)
    assert [x.token_ids for x in top1] == greedy == [x.token_ids for x in tiny_p]


def test_top_k_and_top_p_keep_samples_inside_the_allowed_set(model):
    prompt = PROMPTS[1]
    ids, mask = left_padded([prompt])
    logits = np.asarray(forward(model, ids, mask))[0, -1]
    top5 = set(np.argsort(logits)[-5:].tolist())
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    for seed in range(12):
        [k] = generate(model, [prompt], max_new_tokens=1, top_k=5, seed=seed)
        [p] = generate(model, [prompt], max_new_tokens=1, top_p=0.5, seed=seed)
        assert k.token_ids[0] in top5 and p.token_ids[0] in nucleus


def test_compiles_a_bounded_number_of_times(checkpoints):
    model = from_pretrained(checkpoints["qwen3_tied"], dtype=jnp.float32)
    slot_pool.extend_pass.clear_cache()
    slot_pool.decode_pass.clear_cache()
    rng = np.random.default_rng(1)
    prefills, decodes = set(), set()
    for _ in range(20):
        batch, longest = int(rng.integers(1, 4)), int(rng.integers(1, 31))
        prompts = [
            rng.integers(0, VOCAB, rng.integers(1, longest + 1)).tolist() for _ in range(batch)
        ]
        new = int(rng.integers(1, 9))
        generate(model, prompts, max_new_tokens=new, temperature=0)
        prefills.add((bucket(batch), bucket(max(map(len, prompts)), 16)))
        if new > 1:  # one decode call of 16 steps (every budget here buckets there)
            decodes.add(bucket(batch))
    # row buckets {1, 2, 4} x prompt buckets {16, 32}, one pool length (128 slots): at most 6
    # prefill programs, one per shape seen, and a decode program per row bucket
    assert slot_pool.extend_pass._cache_size() == len(prefills) <= 6
    assert slot_pool.decode_pass._cache_size() == len(decodes) <= 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_k": -1}, "top_k must be in"),
        ({"prompts": [[1], []]}, "prompt 1 is empty"),
        ({"prompts": [[1, VOCAB]]}, f"outside \\[0, {VOCAB}\\): \\[{VOCAB}\\]"),
    ],
)
def test_bad_arguments_name_the_value(model, kwargs, message):
    kwargs = {"prompts": [[1, 2]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate(model, kwargs.pop("prompts"), **kwargs)


def test_empty_prompt_list_returns_nothing(model):
    assert generate(model, [], max_new_tokens=3) == []


def test_a_batch_over_the_cache_budget_is_split_into_independent_calls(model):
    prompts = [PROMPTS[1]] * 3 + [PROMPTS[3]]  # slots per row: 20 prompt + 16 steps -> 128
    want = generate(model, prompts, max_new_tokens=5, temperature=0)
    split = generate(model, prompts, max_new_tokens=5, temperature=0, max_cache_tokens=2 * 128)
    assert [c.token_ids for c in split] == [c.token_ids for c in want]
    # every row draws from its own key: the split samples exactly what one call would
    sampled = generate(model, prompts, max_new_tokens=8, temperature=1.0, seed=1)
    split = generate(
        model, prompts, max_new_tokens=8, temperature=1.0, seed=1, max_cache_tokens=2 * 128
    )
    assert [c.token_ids for c in split] == [c.token_ids for c in sampled]
    assert len({tuple(c.token_ids) for c in sampled[:3]}) > 1  # same prompt, different keys
    too_small = r"one request needs 128 cache slots .* max_cache_tokens=100"
    with pytest.raises(ValueError, match=too_small):
        generate(model, prompts, max_new_tokens=5, max_cache_tokens=100)


def test_a_row_samples_the_same_tokens_whatever_shares_its_batch(model):
    """Per-request keys (docs/design.md#determinism): a request's sample depends on its key, not
    on the batch it lands in, its position there, or the batch's padded size."""
    keys = jnp.stack([sampling.path_key(7, (3, e, 1, 0)) for e in range(len(PROMPTS))])
    together = generate(model, PROMPTS, max_new_tokens=10, temperature=1.0, keys=keys)
    for i in (0, 3):
        [alone] = generate(
            model, [PROMPTS[i]], max_new_tokens=10, temperature=1.0, keys=keys[i : i + 1]
        )
        assert alone.token_ids == together[i].token_ids
        np.testing.assert_allclose(alone.logprobs, together[i].logprobs, rtol=1e-5, atol=1e-5)
    reordered = generate(model, PROMPTS[::-1], max_new_tokens=10, temperature=1.0, keys=keys[::-1])
    assert [c.token_ids for c in reordered[::-1]] == [c.token_ids for c in together]
    other = generate(
        model,
        PROMPTS,
        max_new_tokens=10,
        temperature=1.0,
        keys=jnp.stack([sampling.path_key(7, (4, e, 1, 0)) for e in range(len(PROMPTS))]),
    )
    assert [c.token_ids for c in other] != [c.token_ids for c in together]  # another step


def test_path_keys_are_fold_in_chains_and_refuse_bad_values(model):
    chain = jax.random.fold_in(jax.random.fold_in(jax.random.key(5), 2), 9)
    assert (jax.random.key_data(sampling.path_key(5, (2, 9))) == jax.random.key_data(chain)).all()
    with pytest.raises(ValueError, match=r"seed 5, path \(2, -1\)"):
        sampling.path_key(5, (2, -1))
    with pytest.raises(ValueError, match=r"keys has shape \(2,\), want one key per prompt \(4,\)"):
        generate(model, PROMPTS, max_new_tokens=2, keys=sampling.row_keys(0, 2))


@pytest.mark.parametrize(
    ("prompt", "settings", "message"),
    [
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ([1, 2], {"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ([1, 2], {"temperature": float("nan")}, "temperature must be >= 0, got nan"),
        ([1, 2], {"top_p": 2.0}, r"top_p must be in \(0, 1\], got 2.0"),
        ([], {}, "prompt 0 is empty"),
        (
            [1] * 60,
            {"max_new_tokens": 8},
            "prompt 0 has 60 tokens; with max_new_tokens=8 that passes the model's "
            "max_position_embeddings=64",
        ),
    ],
)
def test_requests_the_sampler_cannot_serve_are_refused_naming_the_value(prompt, settings, message):
    config = dataclasses.replace(ModelConfig.tiny(32), max_position_embeddings=64)
    model = Decoder(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        generate(model, [prompt], **{"max_new_tokens": 4, **settings})
