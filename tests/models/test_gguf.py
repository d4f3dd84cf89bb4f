"""GGUF reading on tiny files written as llama.cpp writes them: names, q/k layout, quant types,
tokenizer metadata, and one clear error for each bad file."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import CheckpointError
from models.decoder import Decoder
from models.export import hf_tensors
from models.hf import checkpoint_config, from_pretrained, load_checkpoint
from models.tokenizer import chat_prompt_ids
from tests.models.gguf_fixtures import TOKENS, tiny_config, write_gguf

Q = gguf.GGMLQuantizationType


def random_decoder(**kwargs) -> Decoder:
    model = Decoder(tiny_config(**kwargs), dtype=jnp.float32, rngs=nnx.Rngs(0))
    # O(1) weights so that a wrong row order moves the logits visibly
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax_tree_scale(state, 0.3))
    return model


def jax_tree_scale(state, scale):
    import jax

    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
        tree,
        [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)],
    )


@pytest.mark.parametrize("tied", [False, True])
def test_float32_gguf_loads_to_the_same_model(tmp_path, tied):
    model = random_decoder(tie_word_embeddings=tied)
    path = tmp_path / "tiny.gguf"
    write_gguf(model, path)
    assert checkpoint_config(path) == model.config
    loaded = from_pretrained(path, dtype=jnp.float32)
    for name, value in hf_tensors(model).items():  # q/k rows back in HF's order, exactly
        np.testing.assert_array_equal(hf_tensors(loaded)[name], value, err_msg=name)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, len(TOKENS), (2, 9)))
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))


@pytest.mark.parametrize("quant", [Q.F16, Q.Q8_0, Q.Q4_1, Q.Q4_0])
def test_quantized_tensors_dequantize_as_ggml_does(tmp_path, quant):
    model = random_decoder()
    path = tmp_path / f"tiny-{quant.name}.gguf"
    expected = write_gguf(model, path, quant)
    got = hf_tensors(from_pretrained(path, dtype=jnp.float32))
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    error = max(np.abs(got[n] - v).max() for n, v in hf_tensors(model).items())
    assert 0 < error < 0.3  # really quantized, and still close to the original


def test_folder_with_one_gguf_and_its_tokenizer(tmp_path):
    model = random_decoder()
    write_gguf(model, tmp_path / "tiny.gguf")
    loaded, tokenizer, stop = load_checkpoint(tmp_path, dtype=jnp.float32)
    assert loaded.config == model.config
    assert stop == (TOKENS.index("<|im_end|>"),)
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert ids[0] == TOKENS.index("<|im_start|>")  # the markers are single special tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi\nassistant\n"


def test_a_truncated_gguf_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "cut.gguf"
    write_gguf(random_decoder(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.* is not a readable GGUF file"):
        from_pretrained(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf.* is not a readable GGUF file"):
        checkpoint_config(path)


def test_an_unsupported_architecture_is_refused(tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(random_decoder(), path, architecture="gpt2")
    with pytest.raises(CheckpointError, match=r"other\.gguf.* holds a 'gpt2' model; .*'llama'"):
        from_pretrained(path)


def test_a_folder_with_two_ggufs_asks_which(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        write_gguf(random_decoder(), tmp_path / name)
    with pytest.raises(CheckpointError, match=r"several GGUF files \(\['a.gguf', 'b.gguf'\]\)"):
        from_pretrained(tmp_path)
