import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from mmgrpo_jax.sampler.generate import generate
from models.hf import from_pretrained
from models.lora import LoRAConfig
from models.sharding import make_mesh, param_sharding, param_spec, shard_model
from tests.models.hf_fixtures import VOCAB
from tests.models.test_lora import TWO, perturb, row_logits

LORA = LoRAConfig(rank=4, alpha=8.0)
IDS = np.random.default_rng(2).integers(0, VOCAB, (4, 13))
PROMPTS = [IDS[i, : 3 + 3 * i].tolist() for i in range(4)]


@nnx.jit
def logits(model, ids):
    return model(ids)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= 8, "tests/conftest.py sets 8 fake CPU devices"
    return make_mesh((2, 2, 2), jax.devices()[:8])


@pytest.mark.parametrize("name", ["llama31", "qwen3_tied", "qwen2_bias"])
def test_sharded_logits_and_greedy_tokens_equal_single_device(checkpoints, mesh, name):
    single = perturb(from_pretrained(checkpoints[name], dtype=jnp.float32, lora=LORA))
    sharded = perturb(from_pretrained(checkpoints[name], dtype=jnp.float32, lora=LORA, mesh=mesh))
    q = sharded.layers.self_attn.q_proj  # stacked over layers: the layer axis stays whole
    layers, _, width = q.kernel[...].shape
    assert q.kernel[...].sharding.spec == P(None, "fsdp", "tensor")
    assert q.kernel[...].addressable_shards[0].data.shape == (layers, 32, width // 2)
    assert q.lora_b[...].sharding.spec == P(None, None, "tensor")
    assert sharded.layers.mlp.down_proj.kernel[...].sharding.spec == P(None, "tensor", "fsdp")
    ids = jax.device_put(IDS, jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), None)))
    want = np.asarray(logits(single, IDS))
    # float32 reduction order differs across shards: most logits agree to ~6e-7, a few (one
    # position of qwen2_bias, whose q/k biases sharpen attention) to ~3e-5 at logits of ~5
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.asarray(logits(sharded, ids)), want, rtol=1e-5, atol=1e-5 * scale)
    greedy = generate(single, PROMPTS, max_new_tokens=6, temperature=0)
    greedy_sharded = generate(sharded, PROMPTS, max_new_tokens=6, temperature=0, mesh=mesh)
    assert [c.token_ids for c in greedy_sharded] == [c.token_ids for c in greedy]
    np.testing.assert_allclose(
        [c.logprobs for c in greedy_sharded], [c.logprobs for c in greedy], atol=1e-5
    )


def test_shard_model_places_an_existing_model(checkpoints, mesh):
    model = from_pretrained(checkpoints["qwen3_sharded"], dtype=jnp.float32, lora=LORA)
    shard_model(model, mesh)
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        assert var.get_value().sharding.spec == param_spec(path)


def test_every_parameter_has_a_rule_and_bad_divisibility_is_named(checkpoints):
    model = from_pretrained(checkpoints["qwen2_bias"], dtype=jnp.float32, lora=LORA)
    for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        param_spec(path)
    with pytest.raises(ValueError, match=r"no partition rule for parameter 'layers\.weird'"):
        param_spec(("layers", "weird"))
    mesh = make_mesh((1, 1, 8), jax.devices()[:8])
    bias = ("layers", "self_attn", "k_proj", "bias")
    with pytest.raises(ValueError, match=r"k_proj\.bias: dimension 12 of shape \(2, 12\) does"):
        param_sharding(bias, (2, 12), mesh)


def test_stacked_adapters_shard_like_one_and_keep_the_adapter_axis_whole(checkpoints, mesh):
    single = perturb(from_pretrained(checkpoints["llama31"], dtype=jnp.float32, lora=TWO))
    sharded = shard_model(
        perturb(from_pretrained(checkpoints["llama31"], dtype=jnp.float32, lora=TWO)), mesh
    )
    q = sharded.layers.self_attn.q_proj  # [layers, adapters, in, r] and [layers, adapters, r, out]
    assert q.lora_a[...].sharding.spec == P(None, None, "fsdp", None)
    assert q.lora_b[...].sharding.spec == P(None, None, None, "tensor")
    adapters = jnp.array([1, 0, 1, 0])
    want = np.asarray(row_logits(single, IDS, adapters))
    got = np.asarray(row_logits(sharded, IDS, adapters))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
