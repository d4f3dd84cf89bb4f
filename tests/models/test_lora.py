import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from models import hf
from models.export import (
    load_peft_adapter,
    merge_lora,
    save_merged,
    save_peft_adapter,
    without_lora,
)
from models.hf import from_pretrained
from models.lora import LoRAConfig
from tests.models.hf_fixtures import VOCAB, load_hf

IDS = np.random.default_rng(1).integers(0, VOCAB, (2, 11))
LORA = LoRAConfig(rank=4, alpha=8.0)


@nnx.jit(static_argnames="use_lora")
def logits(model, ids, use_lora=True):
    return model(ids, use_lora=use_lora)


def perturb(model, seed=0, scale=0.2):
    """Random A and B, large enough to move the logits by O(1)."""
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        jax.device_put(scale * jax.random.normal(k, x.shape, x.dtype), x.sharding)
        for k, x in zip(keys, leaves, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(tree, new))
    return model


@pytest.fixture(scope="module", params=["llama31", "qwen3_tied"])
def directory(request, checkpoints):
    return checkpoints[request.param]


def test_fresh_adapter_leaves_logits_identical(directory):
    base = from_pretrained(directory, dtype=jnp.float32)
    adapted = from_pretrained(directory, dtype=jnp.float32, lora=LORA)
    # B = 0 adds exact zeros: eager logits are identical; jitted, the two programs may fuse
    # their matmuls differently (measured 1.5e-6 on logits of magnitude 5).
    np.testing.assert_allclose(logits(adapted, IDS), logits(base, IDS), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(adapted(jnp.asarray(IDS)), base(jnp.asarray(IDS)))  # eager
    b = [
        x
        for path, x in nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))
        if path[-1] == "lora_b"
    ]
    assert b and all(not np.any(v.get_value()) for v in b)


def test_lora_params_are_typed_and_filterable(directory):
    model = from_pretrained(
        directory, dtype=jnp.float32, lora=LoRAConfig(rank=2, targets=("q_proj", "v_proj"))
    )
    lora = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    base = nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    assert {p[-2] for p, _ in lora} == {"q_proj", "v_proj"}
    assert len(lora) == 2 * 2  # each stacked over the layers
    assert not any(p[-1].startswith("lora") for p, _ in base)
    q = model.layers.self_attn.q_proj
    assert q.lora_a[...].shape == (model.config.num_layers, model.config.hidden_size, 2)
    bound = 1 / model.config.hidden_size**0.5
    assert 0.5 * bound < np.abs(np.asarray(q.lora_a[...])).max() <= bound  # PEFT kaiming init


def test_lora_off_is_the_base_model_and_merge_matches(directory, tmp_path):
    base = from_pretrained(directory, dtype=jnp.float32)
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=LORA))
    on, off = np.asarray(logits(model, IDS)), np.asarray(logits(model, IDS, use_lora=False))
    assert np.abs(on - off).max() > 0.1
    np.testing.assert_array_equal(off, np.asarray(logits(base, IDS)))
    view = without_lora(model)  # the base model again, sharing the arrays
    assert view.lora is None and not nnx.state(view, nnx.LoRAParam)
    assert view.layers.mlp.up_proj.kernel[...] is model.layers.mlp.up_proj.kernel[...]
    np.testing.assert_array_equal(np.asarray(logits(view, IDS)), off)
    in_memory = merge_lora(model)
    assert in_memory.lora is None and not nnx.state(in_memory, nnx.LoRAParam)
    scale = 2e-4 * max(1, np.abs(on).max())
    np.testing.assert_allclose(np.asarray(logits(in_memory, IDS)), on, atol=scale)
    merged = from_pretrained(save_merged(model, tmp_path / "merged"), dtype=jnp.float32)
    np.testing.assert_allclose(
        np.asarray(logits(merged, IDS)), on, atol=2e-4 * max(1, np.abs(on).max())
    )


def test_a_checkpoint_too_big_for_the_machine_is_refused_before_loading(directory, monkeypatch):
    monkeypatch.setattr(hf, "device_memory_bytes", lambda device=None: 1000)
    with pytest.raises(MemoryError, match=r"parameters need .* GiB in bfloat16 .* more than"):
        from_pretrained(directory)


def test_merged_checkpoint_loads_in_transformers(directory, tmp_path):
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=LORA))
    hf = load_hf(save_merged(model, tmp_path / "merged"))
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.numpy()
    got = np.asarray(logits(model, IDS))
    np.testing.assert_allclose(got, want, atol=2e-4 * max(1, np.abs(want).max()))


def test_peft_adapter_loads_with_peft_and_gives_the_same_logits(directory, tmp_path):
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=LORA))
    adapter = save_peft_adapter(model, tmp_path / "adapter", base_model=str(directory))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    hf = peft.PeftModel.from_pretrained(load_hf(directory), adapter).eval()
    with torch.no_grad():
        want = hf(torch.tensor(IDS)).logits.numpy()
    got = np.asarray(logits(model, IDS))
    np.testing.assert_allclose(got, want, atol=2e-4 * max(1, np.abs(want).max()))


def test_peft_adapter_round_trips(directory, tmp_path):
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=LORA), seed=4)
    adapter = save_peft_adapter(model, tmp_path / "adapter")
    fresh = load_peft_adapter(from_pretrained(directory, dtype=jnp.float32, lora=LORA), adapter)
    np.testing.assert_array_equal(logits(fresh, IDS), logits(model, IDS))
    other = from_pretrained(directory, dtype=jnp.float32, lora=LoRAConfig(rank=8))
    with pytest.raises(ValueError, match="does not match the model's LoRAConfig"):
        load_peft_adapter(other, adapter)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank must be >= 1, got 0"),
        ({"alpha": 0}, "alpha must be > 0, got 0"),
        ({"targets": ("q_proj", "lm_head")}, "targets must be a non-empty subset"),
        ({"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_bad_lora_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**kwargs)


def test_lora_dropout_acts_only_with_a_training_stream(checkpoints):
    lora = LoRAConfig(rank=4, alpha=8.0, dropout=0.5)
    model = perturb(from_pretrained(checkpoints["qwen3_tied"], dtype=jnp.float32, lora=lora))
    ids = jnp.asarray(IDS)
    plain = np.asarray(model(ids))
    first = np.asarray(model(ids, rngs=nnx.Rngs(dropout=0)))
    again = np.asarray(model(ids, rngs=nnx.Rngs(dropout=0)))
    other = np.asarray(model(ids, rngs=nnx.Rngs(dropout=1)))
    assert np.abs(first - plain).max() > 1e-2 and np.abs(first - other).max() > 1e-2
    np.testing.assert_array_equal(first, again)  # the stream, not hidden state, decides
    np.testing.assert_array_equal(np.asarray(model(ids, rngs=None)), plain)
    off = np.asarray(model(ids, use_lora=False, rngs=nnx.Rngs(dropout=0)))
    np.testing.assert_array_equal(off, np.asarray(model(ids, use_lora=False)))
