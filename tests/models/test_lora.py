import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx

from models import hf
from models.decoder import Decoder
from models.export import (
    adapter_lora_config,
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


@nnx.jit
def row_logits(model, ids, adapters):  # per-module adapters: each row's adapter id
    return model(ids, use_lora=adapters)


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
        ({"modules": ("query*",)}, "entries are 'pattern=adapter'"),
        ({"modules": ("=a",)}, "entries are 'pattern=adapter'"),
        ({"modules": ("q=a=b",)}, "entries are 'pattern=adapter'"),
        ({"modules": ("q=../x",)}, r"adapter names are letters, .* got '\.\./x'"),
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


# -- per-module adapters -------------------------------------------------------------------------
TWO = LoRAConfig(rank=4, alpha=8.0, modules=("query*=writer", "*=reader"))


def test_modules_map_predictor_names_to_adapters_first_match_first():
    assert TWO.adapter_names == ("writer", "reader") and TWO.num_adapters == 2
    assert [TWO.adapter_id(n) for n in ("query", "query_2", "answer", "hop.query")] == [0, 0, 1, 1]
    assert LoRAConfig().adapter_names == ("default",) and LoRAConfig().adapter_id("any") == 0
    assert LoRAConfig(modules=("*=shared",)).num_adapters == 1
    with pytest.raises(ValueError, match=r"predictor .answer. matches no LoRAConfig\.modules"):
        LoRAConfig(modules=("query=q",)).adapter_id("answer")
    with pytest.raises(ValueError, match=r"adapters \['reader'\] serve none"):
        TWO.check_predictors(["query"])
    assert TWO.check_predictors(["query", "answer"]) == {"query": 0, "answer": 1}
    with pytest.raises(ValueError, match=r"entries \['quer=writer'\] choose none"):
        LoRAConfig(modules=("query*=writer", "quer=writer", "*=reader")).check_predictors(
            ["query", "answer"]
        )


def single_adapter(model, adapter):
    """A one-adapter copy of a model with several, holding adapter `adapter`'s weights."""
    lora = dataclasses.replace(model.lora, modules=())
    graphdef, _ = nnx.split(
        nnx.eval_shape(
            lambda: Decoder(model.config, lora=lora, dtype=model.dtype, rngs=nnx.Rngs(0))
        )
    )
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        if path[-1] in ("lora_a", "lora_b"):
            value = value[:, adapter] if path[0] == "layers" else value[adapter]
        flat.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def test_stacked_adapters_serve_each_row_its_own_adapter(directory):
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=TWO), scale=0.3)
    shapes = {
        path[-1]: var.get_value().shape
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
        if path[-2] == "q_proj"
    }
    layers, hidden = model.config.num_layers, model.config.hidden_size
    assert shapes["lora_a"] == (layers, 2, hidden, 4)
    ids = jnp.asarray(IDS)
    mixed = np.asarray(row_logits(model, ids, jnp.array([1, 0])))
    for row, adapter in ((0, 1), (1, 0)):
        alone = np.asarray(logits(single_adapter(model, adapter), ids))
        # the same sums in another order (a gathered einsum, not a matmul): rounding apart
        np.testing.assert_allclose(mixed[row], alone[row], rtol=1e-4, atol=1e-4)
    assert np.abs(alone - np.asarray(logits(single_adapter(model, 1), ids))).max() > 1e-2
    np.testing.assert_array_equal(
        logits(model, ids, use_lora=False), logits(single_adapter(model, 0), ids, use_lora=False)
    )
    with pytest.raises(ValueError, match=r"2 adapters \['writer', 'reader'\]: pass use_lora"):
        model(ids)


def test_each_per_module_adapter_exports_as_a_peft_folder(directory, tmp_path):
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=TWO), seed=2)
    folder = save_peft_adapter(model, tmp_path / "adapter", base_model=str(directory))
    modules = json.loads((folder / "modules.json").read_text())
    assert modules == {"modules": list(TWO.modules), "adapters": ["writer", "reader"]}
    ids = torch.tensor(IDS)
    for index, name in enumerate(TWO.adapter_names):
        hf = peft.PeftModel.from_pretrained(load_hf(directory), folder / name).eval()
        with torch.no_grad():
            want = hf(ids).logits.numpy()
        got = np.asarray(row_logits(model, IDS, jnp.full((2,), index)))
        np.testing.assert_allclose(got, want, atol=2e-4 * max(1, np.abs(want).max()))
    # and back: the folder names its config, and the adapters load into their slots
    lora = adapter_lora_config(folder)
    assert (lora.rank, lora.alpha, lora.modules) == (TWO.rank, TWO.alpha, TWO.modules)
    assert sorted(lora.targets) == sorted(TWO.targets)
    fresh = load_peft_adapter(from_pretrained(directory, dtype=jnp.float32, lora=lora), folder)
    for index in range(2):
        rows = jnp.full((2,), index)
        np.testing.assert_array_equal(row_logits(fresh, IDS, rows), row_logits(model, IDS, rows))
    with pytest.raises(ValueError, match="holds adapters"):
        load_peft_adapter(from_pretrained(directory, dtype=jnp.float32, lora=LORA), folder)


def test_stacked_adapters_start_at_the_single_adapters_scale(directory):
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) for every adapter of a stack, as for one adapter (a bound
    from the stack's leading axis would start them many times larger)."""
    for lora in (LORA, TWO):
        model = from_pretrained(directory, dtype=jnp.float32, lora=lora)
        a = np.asarray(model.layers.self_attn.q_proj.lora_a[...])  # [L, (n,) in, r]
        bound = 1 / np.sqrt(a.shape[-2])
        assert bound * 0.8 < np.abs(a).max() <= bound, lora


def test_a_merged_model_serves_the_adapter_it_names(directory, tmp_path):
    model = perturb(from_pretrained(directory, dtype=jnp.float32, lora=TWO), scale=0.3)
    ids = jnp.asarray(IDS)
    for index, name in enumerate(TWO.adapter_names):
        merged = from_pretrained(save_merged(model, tmp_path / name, name), dtype=jnp.float32)
        want = np.asarray(row_logits(model, ids, jnp.full((2,), index)))
        np.testing.assert_allclose(np.asarray(logits(merged, ids)), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"2 adapters \['writer', 'reader'\].*name the one"):
        merge_lora(model)
    with pytest.raises(ValueError, match=r"adapter='nope' is not one of"):
        merge_lora(model, "nope")


def test_saving_over_the_other_layout_leaves_no_stale_file(directory, tmp_path):
    folder = tmp_path / "adapter"
    save_peft_adapter(from_pretrained(directory, dtype=jnp.float32, lora=LORA), folder)
    save_peft_adapter(from_pretrained(directory, dtype=jnp.float32, lora=TWO), folder)
    assert not (folder / "adapter_model.safetensors").exists()
    assert adapter_lora_config(folder).modules == TWO.modules
    save_peft_adapter(from_pretrained(directory, dtype=jnp.float32, lora=LORA), folder)
    assert not (folder / "modules.json").exists() and adapter_lora_config(folder).modules == ()
