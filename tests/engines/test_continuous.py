"""The continuous engine returns what one-request-at-a-time sampling returns
(docs/design.md#determinism)."""

import dataclasses
import time

import jax.numpy as jnp
import numpy as np
import pytest

from mmgrpo_jax.engines.base import Request, RolloutEngine, Sampling
from mmgrpo_jax.engines.continuous import ContinuousEngine
from mmgrpo_jax.sampler.generate import generate, path_key
from mmgrpo_jax.testing import tiny_decoder
from models.hf import from_pretrained
from models.lora import LoRAConfig
from tests.models.hf_fixtures import VOCAB, load_hf
from tests.models.test_lora import perturb, single_adapter
from tests.sampler.test_generate import hf_greedy

STOP = 3
RNG = np.random.default_rng(0)
RAGGED = [tuple(RNG.integers(4, 300, n).tolist()) for n in (5, 12, 1, 20, 40, 7, 130)]
MIXED = [  # settings differ per request: all share the pool's passes
    Sampling(max_new_tokens=5, temperature=0.0),
    Sampling(max_new_tokens=17, temperature=1.0),
    Sampling(max_new_tokens=9, temperature=0.7, top_k=20),
    Sampling(max_new_tokens=30, temperature=1.0, top_p=0.8),
    Sampling(max_new_tokens=2, temperature=1.3, top_k=5, top_p=0.9),
    Sampling(max_new_tokens=1, temperature=1.0),
    Sampling(max_new_tokens=12, temperature=0.0),
]


@pytest.fixture(scope="module")
def model():
    return tiny_decoder(300, hidden_size=64, num_layers=2)


@pytest.fixture
def engine():
    """`engine(model, **settings)`: a ContinuousEngine on this file's settings, closed after the
    test, passed or failed (an engine left open keeps its dispatch thread in the worker)."""
    made: list[ContinuousEngine] = []

    def make(model, **kwargs) -> ContinuousEngine:
        settings = {"stop_token_ids": [STOP], "slots": 3, "decode_steps": 3, "max_wait_s": 0.01}
        made.append(ContinuousEngine(model, **{**settings, **kwargs}))
        return made[-1]

    yield make
    for eng in made:
        eng.close()  # a second close is a no-op


def requests(prompts, settings, step=0):
    return [
        Request(p, s, order=(i, 0, 0), key_path=(step, i, 0, 0))
        for i, (p, s) in enumerate(zip(prompts, settings, strict=True))
    ]


def sample_all(eng, reqs):
    futures = [eng.submit(r) for r in reqs]
    return [f.result(timeout=120) for f in futures]


def assert_same(got, want, atol=1e-5):
    """Tokens exactly; log-probs to float32 rounding (XLA's CPU matmuls round a row slightly
    differently in batches of different sizes: ~2e-6 here)."""
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=atol)


def test_concurrent_requests_sample_what_each_alone_samples(model, engine):
    """Ragged prompts, mixed settings and lengths, more requests than slots: rows join and
    leave the pool between decode calls, and none of it changes a sample."""
    reqs = requests(RAGGED, MIXED)
    eng = engine(model)
    assert isinstance(eng, RolloutEngine)
    together = sample_all(eng, reqs)
    eng.close()
    alone = []
    eng = engine(model)  # one request at a time: each alone in the pool (and compiled once)
    for r in reqs:
        alone += sample_all(eng, [r])
    eng.close()
    assert_same(together, alone)
    # and what `generate` (the whole batch admitted at once) returns for each alone, with the
    # request's own key
    for r, got in zip(reqs, together, strict=True):
        s = r.sampling
        [want] = generate(
            model,
            [r.prompt_ids],
            max_new_tokens=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            eos_token_ids=[STOP],
            keys=path_key(0, r.key_path)[None],
        )
        assert_same([got], [want], atol=1e-5)
    assert [len(c.token_ids) for c in together] == [s.max_new_tokens for s in MIXED]
    other_step = sample_all(engine(model), requests(RAGGED, MIXED, step=1))
    assert [c.token_ids for c in other_step] != [c.token_ids for c in together]


def test_greedy_matches_hf_generate(checkpoints):
    directory = checkpoints["llama31"]
    model, hf = from_pretrained(directory, dtype=jnp.float32), load_hf(directory)
    prompts = [tuple(np.random.default_rng(1).integers(0, VOCAB, n).tolist()) for n in (5, 12, 1)]
    eng = ContinuousEngine(model, stop_token_ids=[], slots=2, decode_steps=4)
    try:
        got = sample_all(eng, requests(prompts, [Sampling(max_new_tokens=10, temperature=0)] * 3))
    finally:
        eng.close()
    want_tokens, want_logps = hf_greedy(hf, [list(p) for p in prompts], 10)
    for i, completion in enumerate(got):
        assert completion.token_ids == want_tokens[i].tolist()
        np.testing.assert_allclose(completion.logprobs, want_logps[i], atol=1e-4)


def test_a_finished_row_returns_while_longer_ones_decode(model, engine):
    eng = engine(model, stop_token_ids=[], decode_steps=2)
    long = eng.submit(Request(RAGGED[0], Sampling(max_new_tokens=120, temperature=0)))
    short = eng.submit(Request(RAGGED[1], Sampling(max_new_tokens=3, temperature=0)))
    assert len(short.result(timeout=60).token_ids) == 3
    assert not long.done()  # the short one did not wait for the pool's longest row
    assert len(long.result(timeout=60).token_ids) == 120
    eng.close()


def test_stop_tokens_end_a_row_and_are_returned(model, engine):
    eng = engine(model, stop_token_ids=[])
    [free] = sample_all(eng, requests([RAGGED[3]], [Sampling(max_new_tokens=20, temperature=0)]))
    eng.close()
    stop = free.token_ids[4]  # stop on the fifth greedy token
    eng = engine(model, stop_token_ids=[stop])
    [stopped] = sample_all(eng, requests([RAGGED[3]], [Sampling(max_new_tokens=20, temperature=0)]))
    eng.close()
    first = free.token_ids.index(stop)
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_shared_prefixes_are_prefilled_once_and_sample_as_unshared(model, engine):
    """The G rollouts' identical first prompts, and prompts that share a long system prompt:
    copied caches give the samples of prefilling each prompt whole."""
    system = tuple(RNG.integers(4, 300, 70).tolist())
    prompts = [RAGGED[4]] * 4 + [system + tail for tail in RAGGED[:4]]
    settings = [Sampling(max_new_tokens=8, temperature=1.0)] * len(prompts)
    reqs = requests(prompts, settings)
    shared_engine = engine(model, slots=8)
    shared = sample_all(shared_engine, reqs)
    unshared_engine = engine(model, slots=8, prefix_sharing=False)
    unshared = sample_all(unshared_engine, reqs)
    assert_same(shared, unshared, atol=1e-5)
    # 3 copies of a 39-token prefix (the last token is prefilled: it samples the first token),
    # and at least 3 of the 70-token system prompt
    assert shared_engine.stats.shared_prefix_tokens >= 3 * 39 + 3 * 70
    assert unshared_engine.stats.shared_prefix_tokens == 0
    # every prompt token counted once, and the saved share is the copied tokens' share of them
    for eng in (shared_engine, unshared_engine):
        assert eng.stats.prompt_tokens == sum(len(p) for p in prompts)
    stats = shared_engine.stats
    assert stats.prefill_saved == stats.shared_prefix_tokens / stats.prompt_tokens > 0.4
    assert unshared_engine.stats.prefill_saved == 0.0
    # a later request reuses what a finished row still holds
    before = shared_engine.stats.shared_prefix_tokens
    later = requests([system + RAGGED[5]], settings[:1])
    assert_same(sample_all(shared_engine, later), sample_all(unshared_engine, later))
    assert shared_engine.stats.shared_prefix_tokens - before >= 70
    shared_engine.close()
    unshared_engine.close()


def test_compiles_stay_bounded_over_a_long_run(model, engine):
    """Buckets of rows, prompt tokens and cache window: a long run of random calls compiles
    within the buckets it can touch, and replaying a workload compiles nothing new."""
    eng = engine(model, slots=4, decode_steps=4)
    rng = np.random.default_rng(2)
    workloads = []
    for step in range(8):
        prompts = [
            tuple(rng.integers(4, 300, int(rng.integers(1, 60))).tolist()) for _ in range(10)
        ]
        settings = [
            Sampling(max_new_tokens=int(rng.integers(1, 40)), temperature=float(rng.choice([0, 1])))
            for _ in prompts
        ]
        workloads.append(requests(prompts, settings, step))
        sample_all(eng, workloads[-1])
    compiled = eng.stats.compiles
    # extend: rows {1, 2, 4} x prompt widths {16, 32, 64}; decode: rows {1, 2, 4}; one window;
    # greedy-only or sampled for each: at most 24, against hundreds of calls
    assert compiled <= 2 * (9 + 3)
    assert eng.stats.dispatches > 5 * compiled
    for reqs in workloads[:3]:
        sample_all(eng, reqs)
    assert eng.stats.compiles == compiled
    eng.close()


def test_bad_requests_fail_in_their_caller_only(model, engine):
    eng = engine(model, max_cache_tokens=3 * 256)
    good = eng.submit(Request(RAGGED[0], Sampling(max_new_tokens=4, temperature=0)))
    bad = [
        eng.submit(Request((), Sampling(max_new_tokens=4))),
        eng.submit(Request((1, 300), Sampling(max_new_tokens=4))),
        eng.submit(Request((1,), Sampling(max_new_tokens=4, top_p=0.0))),
        eng.submit(Request((1,) * 200, Sampling(max_new_tokens=100))),
        eng.submit(Request((1,), Sampling(max_new_tokens=4, temperature=-1.0))),
        eng.submit(Request((1,) * 8190, Sampling(max_new_tokens=4))),
    ]
    messages = [
        "prompt 0 is empty",
        r"outside \[0, 300\): \[300\]",
        "top_p must be in",
        "exceed",
        "temperature must be >= 0, got -1.0",
        "prompt 0 has 8190 tokens; with max_new_tokens=4 that passes the model's "
        "max_position_embeddings=8192",
    ]
    for future, message in zip(bad, messages, strict=True):
        with pytest.raises(ValueError, match=message):
            future.result(timeout=60)
    assert len(good.result(timeout=60).token_ids) == 4
    eng.close()


def test_close_fails_live_and_queued_requests(model, engine):
    eng = engine(model, stop_token_ids=[], decode_steps=1, slots=1)
    futures = [
        eng.submit(Request(RAGGED[0], Sampling(max_new_tokens=200, temperature=0))),
        eng.submit(Request(RAGGED[1], Sampling(max_new_tokens=4, temperature=0))),
    ]
    time.sleep(0.5)
    eng.close()
    for future in futures:
        with pytest.raises(RuntimeError, match="closed"):
            future.result(timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit(Request(RAGGED[0], Sampling(max_new_tokens=1)))


def test_stats_say_how_full_the_pool_was(model, engine):
    eng = engine(model, slots=4, stop_token_ids=[])
    sample_all(eng, requests(RAGGED[:4], [Sampling(max_new_tokens=10, temperature=0)] * 4))
    stats = eng.stats
    assert stats.requests == 4 and stats.tokens == 40
    assert stats.row_steps == 36  # the first token of each comes from its prefill
    assert 0.5 < stats.occupancy <= 1.0
    assert stats.sample_s > 0 and stats.queue_wait_s >= 0
    eng.close()


def test_a_held_prefix_survives_the_decode_calls_after_its_row_finished(model, engine):
    """Idle rows sit in every in-place decode call: their writes must not touch what they hold."""
    system = tuple(RNG.integers(4, 300, 60).tolist())
    donor = Request(system + RAGGED[0], Sampling(max_new_tokens=2), key_path=(0, 0, 0, 0))
    long = Request(RAGGED[1], Sampling(max_new_tokens=80), key_path=(0, 1, 0, 0))
    later = Request(system + RAGGED[3], Sampling(max_new_tokens=6), key_path=(0, 2, 0, 0))
    results = {}
    for sharing in (True, False):
        eng = engine(model, stop_token_ids=[], slots=4, decode_steps=2, prefix_sharing=sharing)
        sample_all(eng, [donor, long])  # the donor idles through ~40 decode calls
        results[sharing] = sample_all(eng, [later])
        if sharing:
            assert eng.stats.shared_prefix_tokens >= 60
        eng.close()
    assert_same(results[True], results[False])


def test_a_bad_key_path_fails_its_caller_only(model, engine):
    eng = engine(model)
    bad = eng.submit(Request(RAGGED[0], Sampling(max_new_tokens=3), key_path=(-1, 0, 0, 0)))
    good = eng.submit(Request(RAGGED[1], Sampling(max_new_tokens=3), key_path=(0, 0, 0, 0)))
    with pytest.raises(ValueError, match="key path"):
        bad.result(timeout=60)
    assert len(good.result(timeout=60).token_ids) == 3
    eng.close()


def test_a_few_live_requests_decode_a_bucket_of_rows_not_the_pool(model, engine):
    """3 requests in a pool of 16 rows: a decode pass computes the power-of-two bucket of rows
    that holds the live ones (4, or 1-2 while a request still waits to join), gathered from the
    pool and scattered back, and samples what one `generate` call samples."""
    eng = engine(model, slots=16, stop_token_ids=[], decode_steps=3)
    settings = [Sampling(max_new_tokens=10, temperature=0)] * 2 + [Sampling(10, temperature=1.0)]
    reqs = requests(RAGGED[:3], settings)
    got = sample_all(eng, reqs)
    stats = eng.stats
    assert stats.row_steps == 27  # the first token of each comes from its prefill
    # a bucket is less than twice its live rows: the whole pool would be 16 x 9 row steps
    assert 27 <= stats.slot_steps < 2 * 27 and stats.occupancy > 0.5
    for r, completion in zip(reqs, got, strict=True):
        [want] = generate(
            model,
            [r.prompt_ids],
            max_new_tokens=10,
            temperature=r.sampling.temperature,
            keys=path_key(0, r.key_path)[None],
        )
        assert_same([completion], [want])
    eng.close()


def test_requests_of_different_adapters_share_the_pool_and_sample_as_alone(engine):
    """Per-module adapters: one pool serves rows of both adapters in the same passes; each
    request gets what its adapter's single-adapter model samples alone (greedy: the same ids),
    and what `generate` samples with the same key and adapter (sampled)."""
    lora = LoRAConfig(rank=4, alpha=8.0, modules=("a*=first", "*=second"))
    model = perturb(tiny_decoder(300, hidden_size=64, num_layers=2, lora=lora), scale=0.3)
    settings = [
        Sampling(max_new_tokens=n, temperature=t)
        for n, t in zip((6, 9, 4, 12, 7, 3, 10), (0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0), strict=True)
    ]
    reqs = [dataclasses.replace(r, adapter=i % 2) for i, r in enumerate(requests(RAGGED, settings))]
    # request 1 extends request 0's long prompt on the other adapter: no cache is shared
    reqs[0] = dataclasses.replace(reqs[0], prompt_ids=RAGGED[6])
    reqs[1] = dataclasses.replace(reqs[1], prompt_ids=RAGGED[6] + RAGGED[1])
    eng = engine(model)
    got = sample_all(eng, reqs)
    eng.close()
    for r, out in zip(reqs, got, strict=True):
        s = r.sampling
        kwargs = {
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature,
            "eos_token_ids": [STOP],
            "keys": path_key(0, r.key_path)[None],
        }
        [want] = generate(model, [r.prompt_ids], adapter_ids=[r.adapter], **kwargs)
        assert_same([out], [want], atol=1e-4)
        if s.temperature == 0:
            [alone] = generate(single_adapter(model, r.adapter), [r.prompt_ids], **kwargs)
            assert out.token_ids == alone.token_ids
    # the adapters differ enough to change what is sampled
    swapped = sample_all(
        engine(model), [dataclasses.replace(r, adapter=1 - r.adapter) for r in reqs]
    )
    assert [c.token_ids for c in swapped] != [c.token_ids for c in got]
    with pytest.raises(ValueError, match="request for adapter 2; this engine's model has 2"):
        engine(model).submit(dataclasses.replace(reqs[0], adapter=2))
    with pytest.raises(ValueError, match="has 1 adapter"):
        engine(tiny_decoder(300, hidden_size=64)).submit(reqs[1])
