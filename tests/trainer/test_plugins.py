"""What a researcher adds without touching the package: a loss variant, a grouping rule, and a
rollout engine of their own, each driving real mmGRPO steps."""

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmgrpo_jax
from mmgrpo_jax import Group, GroupMember, LossConfig, TokenTerms
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.rl.grouping import GROUPINGS
from mmgrpo_jax.rl.losses import VARIANTS
from tests.trainer.test_mmgrpo import TRAIN, VAL, TwoModules, config, new_model, reward, run


def lines(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def lora_of(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.LoRAParam))


def moved(before, after):
    return any(jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after)))


# ---------------------------------------------------------------- a loss variant


def importance_weighted_reinforce(cfg, x):
    """-w * A * logp with w = exp(logp - sampler logp) capped at 2: reads a Batch field by name."""
    sampler = jnp.where(x.mask, x.batch.sampler_logps, 0.0)
    weight = jax.lax.stop_gradient(jnp.minimum(jnp.exp(x.logps - sampler), 2.0))
    loss = -weight * x.advantages * x.logps
    none = jnp.zeros_like(x.mask)
    return TokenTerms(loss, weight, none, none)


@pytest.fixture
def registered_loss():
    mmgrpo_jax.register_loss(
        "is_reinforce", importance_weighted_reinforce, aggregation="token_mean_global"
    )
    yield "is_reinforce"
    VARIANTS.pop("is_reinforce")


def test_a_loss_registered_from_test_code_trains_a_step(tokenizer, tmp_path, registered_loss):
    with pytest.raises(ValueError, match="already registered"):
        mmgrpo_jax.register_loss(registered_loss, importance_weighted_reinforce)
    cfg = config(tmp_path, num_steps=1, eval_every=100, loss=LossConfig(registered_loss))
    model = new_model(tokenizer)
    before = lora_of(model)
    run(tokenizer, cfg, model)
    [step] = [r for r in lines(tmp_path) if "loss" in r]
    assert np.isfinite(step["loss"]) and step["grad_norm"] > 0
    # before the update trainer and sampler agree, so every capped weight is exp(0) = 1
    assert step["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert moved(before, lora_of(model))


def test_unknown_loss_and_grouping_names_list_the_registered_ones(registered_loss):
    with pytest.raises(ValueError, match=r"registered loss \(\[.*'is_reinforce'.*\]"):
        LossConfig("nope")
    with pytest.raises(ValueError, match=r"MMGRPOConfig\.grouping must be a registered grouping"):
        mmgrpo_jax.MMGRPOConfig(grouping="nope")
    with pytest.raises(ValueError, match=r"aggregation of loss 'other' must be a registered"):
        mmgrpo_jax.register_loss("other", importance_weighted_reinforce, aggregation="median")


# ---------------------------------------------------------------- a grouping rule


def module_trajectories(trajectories, settings):
    """Per example and module: each rollout's calls of that module form one member (a
    module-trajectory), so the loss normalises by the tokens of all of them together."""
    groups = []
    for e in sorted({t.example_index for t in trajectories}):
        rollouts = sorted(
            (t for t in trajectories if t.example_index == e), key=lambda t: t.rollout_index
        )
        modules = dict.fromkeys(c.predictor for t in rollouts for c in t.calls)
        for module in modules:
            members = [
                GroupMember(
                    t.rollout_index,
                    t.reward,
                    tuple(c for c in t.calls if c.predictor == module),
                )
                for t in rollouts
            ]
            members = [members[i % len(members)] for i in range(settings.num_rollouts)]
            groups.append(Group(e, module, None, tuple(members)))
    return groups


@pytest.fixture
def registered_grouping():
    mmgrpo_jax.register_grouping("module_trajectory", module_trajectories, unit="trajectory")
    yield "module_trajectory"
    GROUPINGS.pop("module_trajectory")


def test_a_grouping_registered_from_test_code_trains_a_step(
    tokenizer, tmp_path, registered_grouping
):
    model = new_model(tokenizer)
    before = lora_of(model)
    cfg = config(tmp_path, num_steps=1, eval_every=100, grouping=registered_grouping)
    run(tokenizer, cfg, model)
    [step] = [r for r in lines(tmp_path) if "loss" in r]
    assert step["groups"] == 4  # 2 examples x 2 modules
    assert step["groups/draft"] == 2 and step["groups/final"] == 2
    assert np.isfinite(step["loss"]) and moved(before, lora_of(model))
    with pytest.raises(ValueError, match="unit must be one of"):
        mmgrpo_jax.register_grouping("bad", module_trajectories, unit="call")


# ---------------------------------------------------------------- an engine


class RecordingEngine:
    """A third-party engine: it forwards to a JaxEngine and records what the trainer asked."""

    def __init__(self, inner):
        self.inner = inner
        self.requests, self.updates, self.closed = 0, [], False
        self._lock = threading.Lock()

    def submit(self, request):
        with self._lock:
            self.requests += 1
        return self.inner.submit(request)

    def update_weights(self, params):
        self.updates.append(jax.tree.map(np.array, params))
        self.inner.update_weights(params)

    @property
    def stats(self):
        return self.inner.stats

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "requests": self.requests}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])

    def open_client(self):
        self.inner.open_client()

    def close_client(self):
        self.inner.close_client()

    def close(self):
        self.closed = True
        self.inner.close()


def test_a_wrapper_engine_drives_training_and_receives_every_update(tokenizer, tmp_path):
    model = new_model(tokenizer)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    engine = RecordingEngine(JaxEngine(model, stop_token_ids=stop, max_wait_s=10.0))
    assert isinstance(engine, mmgrpo_jax.RolloutEngine)
    cfg = config(tmp_path, num_steps=2, eval_every=100)
    optimizer = mmgrpo_jax.MMGRPO(
        reward, cfg, model=model, tokenizer=tokenizer, stop_token_ids=stop, engine=engine
    )
    optimizer.compile(TwoModules(), TRAIN, VAL)
    # 2 steps x 2 examples x 3 rollouts x 2 modules, plus 2 greedy evaluations x 2 x 2
    assert engine.requests == 24 + 8
    assert len(engine.updates) == 2 and not engine.closed  # a shared engine stays open
    final = lora_of(model)
    jax.tree.map(np.testing.assert_array_equal, engine.updates[-1], final)
    engine.close()


def test_an_engine_factory_is_built_on_the_policy_and_closed(tokenizer, tmp_path):
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    made = []

    def factory(model):
        made.append(RecordingEngine(JaxEngine(model, stop_token_ids=stop, max_wait_s=10.0)))
        return made[-1]

    cfg = config(tmp_path, num_steps=1, eval_every=100)
    optimizer = mmgrpo_jax.MMGRPO(
        reward,
        cfg,
        model=new_model(tokenizer),
        tokenizer=tokenizer,
        stop_token_ids=stop,
        engine=factory,
    )
    optimizer.compile(TwoModules(), TRAIN, VAL)
    [engine] = made
    assert engine.closed and len(engine.updates) == 1


def test_an_engine_that_is_neither_an_engine_nor_a_factory_is_refused(tokenizer):
    class Half:
        def submit(self, request):
            raise AssertionError

    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with pytest.raises(TypeError, match=r"lacks \['update_weights', 'stats'"):
        mmgrpo_jax.MMGRPO(
            reward,
            mmgrpo_jax.MMGRPOConfig(),
            model=new_model(tokenizer),
            tokenizer=tokenizer,
            stop_token_ids=stop,
            engine=Half(),
        )
