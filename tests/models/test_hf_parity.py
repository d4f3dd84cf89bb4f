import json
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from models.attention import AttentionConfig
from models.config import ModelConfig
from models.hf import from_pretrained
from tests.models.hf_fixtures import CHECKPOINTS, VOCAB, load_hf

IDS = np.random.default_rng(0).integers(0, VOCAB, (3, 17))
LENGTHS = np.array([17, 9, 1])
MASK = np.arange(17)[None, :] >= (17 - LENGTHS)[:, None]  # left padding, ragged
POSITIONS = np.maximum(np.cumsum(MASK, axis=1) - 1, 0)


def hf_logits(directory, dtype=torch.float32, mask=None):
    model = load_hf(directory).to(dtype)
    with torch.no_grad():
        kwargs = {}
        if mask is not None:
            kwargs = {
                "attention_mask": torch.tensor(mask, dtype=torch.long),
                "position_ids": torch.tensor(POSITIONS),
            }
        return model(torch.tensor(IDS), **kwargs).logits.float().numpy()


def assert_close_logits(got, want, rel, where=None):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if where is not None:
        got, want = got[where], want[where]
    bound = rel * np.maximum(1.0, np.abs(want))
    worst = np.max(np.abs(got - want) - bound)
    assert worst <= 0, (
        f"max |diff| {np.max(np.abs(got - want)):.3g} exceeds {rel} x max(1, |logit|)"
    )


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_float32_logits_match_hf(checkpoints, name):
    want = hf_logits(checkpoints[name])
    assert np.abs(want).max() > 1.0  # logits are O(1), not vanishing
    model = from_pretrained(checkpoints[name], dtype=jnp.float32)
    assert_close_logits(model(jnp.asarray(IDS)), want, rel=2e-4)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_left_padded_ragged_batch_matches_hf(checkpoints, name):
    want = hf_logits(checkpoints[name], mask=MASK)
    model = from_pretrained(checkpoints[name], dtype=jnp.float32)
    got = model(jnp.asarray(IDS), attention_mask=jnp.asarray(MASK))
    assert_close_logits(got, want, rel=2e-4, where=MASK)
    explicit = model(jnp.asarray(IDS), jnp.asarray(POSITIONS), jnp.asarray(MASK))
    np.testing.assert_array_equal(np.asarray(explicit), np.asarray(got))


@pytest.mark.parametrize("name", ["llama31", "qwen3_tied", "qwen2_bias"])
def test_blockwise_attention_with_remat_matches_hf(checkpoints, name):
    """The memory-lean forward (tiles smaller than the sequence) against HF's eager attention."""
    want = hf_logits(checkpoints[name], mask=MASK)
    model = from_pretrained(checkpoints[name], dtype=jnp.float32)
    model.attention, model.remat = AttentionConfig("blockwise", q_block=4, kv_block=8), True
    got = model(jnp.asarray(IDS), attention_mask=jnp.asarray(MASK))
    assert_close_logits(got, want, rel=2e-4, where=MASK)


# bf16 keeps 8 mantissa bits. Measured on these checkpoints: ours-bf16 vs HF-bf16 <= 0.078 x
# max(1, |logit|), while HF-bf16 vs HF-float32 is itself up to 0.114; the bound sits between.
BF16_RELATIVE = 0.1


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
@pytest.mark.parametrize("name", ["llama31", "qwen3_tied"])
def test_bfloat16_logits_close_to_hf_bfloat16(checkpoints, name, attention):
    want = hf_logits(checkpoints[name], dtype=torch.bfloat16)
    model = from_pretrained(checkpoints[name], dtype=jnp.bfloat16)
    model.attention = AttentionConfig(attention, q_block=4, kv_block=8)
    got = model(jnp.asarray(IDS))
    assert got.dtype == jnp.bfloat16
    assert_close_logits(got, want, rel=BF16_RELATIVE)


def test_llama3_rope_scaling_changes_logits(checkpoints, tmp_path):
    unscaled = tmp_path / "unscaled"
    shutil.copytree(checkpoints["llama31"], unscaled)
    config = json.loads((unscaled / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"  # the old layout was written
    config["rope_scaling"] = None
    (unscaled / "config.json").write_text(json.dumps(config))
    short = jnp.asarray(IDS[:, :5])
    scaled_logits = from_pretrained(checkpoints["llama31"], dtype=jnp.float32)(short)
    plain_logits = from_pretrained(unscaled, dtype=jnp.float32)(short)
    assert np.abs(np.asarray(scaled_logits) - np.asarray(plain_logits)).max() > 1e-2


def test_both_config_layouts_are_read(checkpoints):
    new = json.loads((checkpoints["qwen3_tied"] / "config.json").read_text())
    assert "rope_parameters" in new and "rope_theta" not in new
    assert ModelConfig.from_file(checkpoints["qwen3_tied"] / "config.json").rope_theta == 1e6
    old = ModelConfig.from_file(checkpoints["llama31"] / "config.json")
    assert old.rope_scaling is not None and old.rope_scaling.factor == 8.0
    assert old.rope_theta == 500000.0


@pytest.fixture
def copy_of(checkpoints, tmp_path):
    def copy(name):
        target = tmp_path / name
        shutil.copytree(checkpoints[name], target)
        return target

    return copy


def test_unsupported_model_type_is_named(copy_of):
    directory = copy_of("llama32_tied")
    config = json.loads((directory / "config.json").read_text())
    config["model_type"] = "mistral"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported"):
        from_pretrained(directory)


def test_missing_and_misshaped_tensors_are_named(copy_of):
    directory = copy_of("qwen2_bias")
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(KeyError, match=re.escape("model.layers.1.self_attn.k_proj.bias")):
        from_pretrained(directory)
    tensors["model.layers.1.self_attn.k_proj.bias"] = np.zeros(7, np.float32)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(ValueError, match=r"k_proj.bias' has shape \(7,\), expected \(32,\)"):
        from_pretrained(directory)


def test_missing_files_are_named(copy_of, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    directory = copy_of("qwen3_sharded")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        from_pretrained(directory)
    (directory / "model.safetensors.index.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("no model.safetensors")):
        from_pretrained(directory)
    (directory / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=re.escape("no config.json")):
        from_pretrained(directory)
