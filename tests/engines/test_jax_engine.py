import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmgrpo_jax.engines.base import Request, RolloutEngine, Sampling
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.program import Example, Module, Predict, record_trace
from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.sampler.generate import generate
from mmgrpo_jax.testing import tiny_decoder
from models.lora import LoRAConfig
from models.tokenizer import chat_prompt_ids, train_bpe_tokenizer
from tests.models.test_lora import perturb, single_adapter

MESSAGES = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Which hop?"}]


@pytest.fixture(scope="module")
def tokenizer():
    corpus = ["Answer the question about the claim and the hop."] * 30
    return train_bpe_tokenizer(corpus, 300, "chatml")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_decoder(len(tokenizer), hidden_size=64, num_layers=2)


def make_lm(model, tokenizer, **kwargs):
    settings = {"sampling": Sampling(max_new_tokens=6, temperature=0.0), "max_wait_s": 5.0}
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return EngineLM.local(model, tokenizer, stop_token_ids=stop, **{**settings, **kwargs})


def test_a_call_equals_the_sampler_on_the_chat_prompt(model, tokenizer):
    lm = make_lm(model, tokenizer, max_wait_s=0.01)
    out = lm(MESSAGES)
    prompt = chat_prompt_ids(tokenizer, MESSAGES)
    [want] = generate(
        model, [prompt], max_new_tokens=6, temperature=0, eos_token_ids=lm.engine.stop_token_ids
    )
    assert isinstance(lm.engine, RolloutEngine)
    assert out.prompt_ids == tuple(prompt)
    assert out.completion_ids == tuple(want.token_ids)
    assert out.logprobs == pytest.approx(want.logprobs)
    assert out.finish_reason == want.finish_reason
    assert out.text == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    lm.close()


def test_concurrent_rollouts_share_one_full_batch(model, tokenizer):
    lm = make_lm(model, tokenizer)  # a 5 s timeout: only "everyone is waiting" can dispatch fast
    program = Predict("question -> answer")
    examples = [Example(question=f"q{i}", answer="a").with_inputs("question") for i in range(4)]
    trajectories = run_rollouts(
        program, examples, lambda e, p: 1.0, num_rollouts=4, lm=lm, max_workers=16
    )
    assert lm.stats.dispatches == 1 and lm.stats.requests == 16
    assert lm.stats.occupancy == 16 / 64
    for t in trajectories:
        [call] = t.calls
        assert call.completion_ids and len(call.logprobs) == len(call.completion_ids)
        assert call.prompt_ids[-3:] == tuple(
            tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"][-3:]
        )
    lm.close()


def test_different_sampling_settings_go_to_separate_batches(model, tokenizer):
    lm = make_lm(model, tokenizer)
    outputs, barrier = {}, threading.Barrier(4)

    def client(i):
        lm.open_client()
        barrier.wait()
        try:
            outputs[i] = lm(MESSAGES, temperature=0.0 if i < 2 else 1.0)
        finally:
            lm.close_client()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(outputs) == 4 and outputs[0].completion_ids == outputs[1].completion_ids
    assert lm.stats.dispatches == 2 and lm.stats.requests == 4
    lm.close()


def test_bad_requests_fail_in_the_caller_without_hanging(model, tokenizer):
    lm = make_lm(model, tokenizer, max_prompt_tokens=5, max_wait_s=0.01)
    with pytest.raises(TypeError, match=r"unknown sampling arguments \['seed'\]"):
        lm(MESSAGES, seed=3)
    with pytest.raises(ValueError, match="more than max_prompt_tokens=5"):
        lm(MESSAGES)
    lm.max_prompt_tokens = None
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        lm(MESSAGES, max_new_tokens=0)  # raised by the sampler, re-raised in the caller
    lm.close()
    with pytest.raises(RuntimeError, match="closed"):
        lm(MESSAGES)


def test_update_weights_reaches_the_next_call_and_the_model_is_never_read(model, tokenizer):
    lm = make_lm(model, tokenizer, max_wait_s=0.01)
    before = lm(MESSAGES)
    head = model.lm_head.kernel
    saved = head[...]
    head[...] = jnp.zeros_like(saved)  # mutating the model does not reach the engine
    try:
        untouched = lm(MESSAGES)
        # a copy: the state's variables are the model's own (flat logits: greedy picks 0)
        flat = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    finally:
        head[...] = saved
    lm.engine.update_weights(flat)
    after = lm(MESSAGES)
    assert untouched.completion_ids == before.completion_ids
    assert before.completion_ids[0] != 0
    assert after.completion_ids[0] == 0
    assert after.logprobs[0] == pytest.approx(-np.log(len(tokenizer)), rel=1e-5)
    lm.engine.update_weights(nnx.state(model, nnx.Param))  # and back
    assert lm(MESSAGES).completion_ids == before.completion_ids
    lm.close()


def test_update_weights_names_the_first_mismatch(tokenizer):
    model = tiny_decoder(len(tokenizer), lora=LoRAConfig(rank=2), seed=1)
    engine = JaxEngine(model, stop_token_ids=[0])  # with an adapter: the LoRA params update
    lora = nnx.state(model, nnx.LoRAParam)
    try:
        engine.update_weights(lora)  # the right tree passes
        wrong_shape = jax.tree.map(lambda x: x, lora)
        path = ("layers", "mlp", "down_proj", "lora_a")
        flat = dict(nnx.to_flat_state(wrong_shape))
        flat[path].set_value(jnp.zeros((3, 3), flat[path].get_value().dtype))
        with pytest.raises(ValueError, match=r"'layers.mlp.down_proj.lora_a' has shape \(3, 3\)"):
            engine.update_weights(nnx.from_flat_state(flat))
        half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), lora)
        with pytest.raises(ValueError, match="has dtype bfloat16, the engine's has float32"):
            engine.update_weights(half)
        only_q = nnx.All(nnx.LoRAParam, nnx.PathContains("q_proj"))
        with pytest.raises(ValueError, match=r"missing parameter 'layers\.mlp\.down_proj"):
            engine.update_weights(nnx.state(model, only_q))
        with pytest.raises(ValueError, match="unexpected parameter 'embed"):
            engine.update_weights(nnx.state(model, nnx.Param))
        flat = dict(nnx.to_flat_state(jax.tree.map(lambda x: x, lora)))
        for path in [
            ("layers", "mlp", "up_proj", "lora_b"),
            ("layers", "self_attn", "q_proj", "lora_a"),
        ]:
            flat[path].set_value(flat[path].get_value().at[0, 0].set(jnp.nan))
        with pytest.raises(
            ValueError,
            match=r"'layers.mlp.up_proj.lora_b' has non-finite values "
            r"\(2 parameter\(s\) do\); the engine keeps its weights",
        ):
            engine.update_weights(nnx.from_flat_state(flat))
    finally:
        engine.close()


def test_engine_state_round_trips_the_sampling_counter(model, tokenizer):
    engine = JaxEngine(model, stop_token_ids=[0], max_wait_s=0.01)
    try:
        request = Request((1, 2, 3), Sampling(3, temperature=1.0))
        first = engine.submit(request).result()
        saved = engine.state_dict()
        second = engine.submit(request).result()
        engine.load_state_dict(saved)
        assert engine.submit(request).result() == second  # the same stream again
        assert saved == {"sampled_dispatches": 1}
        engine.submit(Request((1, 2, 3), Sampling(3, temperature=0.0))).result()
        assert engine.state_dict() == {"sampled_dispatches": 2}  # greedy calls draw nothing
        assert first != second or first.token_ids == second.token_ids
    finally:
        engine.close()


def test_trace_records_what_the_policy_sampled(model, tokenizer):
    lm = make_lm(model, tokenizer, max_wait_s=0.01)
    program = Predict("question -> answer")
    with record_trace(program, lm=lm) as trace, pytest.raises(Exception):  # noqa: B017
        program(question="q")  # a random policy cannot write the format
    [call] = trace.calls
    assert not call.parsed and call.completion == lm(call.messages).text
    lm.close()


def test_close_fails_the_queued_requests_instead_of_sampling_them(model, tokenizer):
    engine = JaxEngine(model, stop_token_ids=[0], max_wait_s=60.0)
    engine.open_client()
    engine.open_client()  # two clients, one request: the batch waits for the other
    queued = engine.submit(Request((1, 2, 3), Sampling(3, temperature=0.0)))
    engine.close()
    with pytest.raises(RuntimeError, match="the JaxEngine was closed"):
        queued.result(timeout=5)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(Request((1, 2, 3), Sampling(3, temperature=0.0)))


def test_keyed_rollouts_sample_the_same_alone_or_batched(model, tokenizer):
    """A training rollout's samples are keyed by (seed, step, example, rollout, call): running
    one example of a step alone (a process's share) gives its rollouts of the whole step."""
    sampling = Sampling(max_new_tokens=6, temperature=1.0)
    program = Predict("question -> answer")
    examples = [Example(question=f"q{i}", answer="a").with_inputs("question") for i in range(3)]

    def rollouts(chosen, first_example, step=5, **kwargs):
        lm = make_lm(model, tokenizer, sampling=sampling, seed=11, **kwargs)
        try:
            out = run_rollouts(
                program,
                chosen,
                lambda e, p: 1.0,
                num_rollouts=3,
                lm=lm,
                first_example=first_example,
                key_prefix=(step,),
            )
            return [(t.example_index, t.rollout_index, t.calls[0].completion_ids) for t in out]
        finally:
            lm.close()

    whole = rollouts(examples, 0)
    assert rollouts(examples[2:], 2, max_batch=2) == whole[6:]
    assert len({ids for _, _, ids in whole[6:]}) > 1  # rollouts of one example differ
    assert rollouts(examples, 0, step=6) != whole  # and steps do


def test_update_weights_keeps_the_engines_placement(model, tokenizer):
    """An engine built before the policy went onto a mesh gets sharded weights from the trainer:
    it keeps them on its own device (no copy of the base to every device per call)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.sharding import make_mesh

    engine = JaxEngine(model, stop_token_ids=[0], max_wait_s=0.01)
    try:
        mesh = make_mesh((8, 1, 1), jax.devices()[:8])
        params = nnx.state(model, nnx.Param)
        sharded = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
        engine.update_weights(sharded)
        for leaf in jax.tree.leaves(engine._weights):
            assert len(leaf.devices()) == 1
    finally:
        engine.close()


class DraftThenAnswer(Module):
    def __init__(self):
        self.draft = Predict("question -> draft", bare=True)
        self.answer = Predict("question, draft -> answer", bare=True)

    def forward(self, question):
        return self.answer(question=question, draft=self.draft(question=question).draft)


def test_each_module_calls_its_own_adapter_in_one_mixed_batch(tokenizer):
    """Per-module adapters through EngineLM: a call's request names its predictor's adapter,
    concurrent rollouts batch calls of both modules together, and each call samples what its
    adapter's single-adapter model samples alone."""
    lora = LoRAConfig(rank=4, alpha=8.0, modules=("draft=drafter", "answer=answerer"))
    model = perturb(
        tiny_decoder(len(tokenizer), hidden_size=64, num_layers=2, lora=lora), scale=0.3
    )
    program = DraftThenAnswer()
    examples = [Example(question=f"q{i}").with_inputs("question") for i in range(4)]
    lm = make_lm(model, tokenizer, max_wait_s=0.5)  # routed by lora.modules
    trajectories = run_rollouts(program, examples, lambda e, p: 1.0, num_rollouts=2, lm=lm)
    with pytest.raises(RuntimeError, match="called outside a traced predictor call"):
        lm(MESSAGES)
    with pytest.raises(ValueError, match=r"has 2 adapters .* pass adapter_of="):
        EngineLM(lm.engine, tokenizer, sampling=Sampling(4))  # no silent adapter 0
    lm.close()
    assert lm.stats.dispatches < sum(len(t.calls) for t in trajectories)  # batched, not one by one
    alone = {a: single_adapter(model, a) for a in (0, 1)}
    for call in (c for t in trajectories for c in t.calls):
        [want] = generate(
            alone[lora.adapter_id(call.predictor)],
            [call.prompt_ids],
            max_new_tokens=6,
            temperature=0,
            eos_token_ids=lm.engine.stop_token_ids,
        )
        assert call.completion_ids == tuple(want.token_ids), call.predictor
    drafts = {c.completion_ids for t in trajectories for c in t.calls if c.predictor == "draft"}
    [swapped] = generate(
        alone[1],
        [trajectories[0].calls[0].prompt_ids],
        max_new_tokens=6,
        temperature=0,
        eos_token_ids=lm.engine.stop_token_ids,
    )
    assert tuple(swapped.token_ids) not in drafts  # the other adapter would sample otherwise
