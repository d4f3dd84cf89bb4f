"""The public tiny checkpoint: written without torch, read by transformers as by us."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mmgrpo_jax import cli
from models.hf import from_pretrained
from models.tiny_checkpoint import write_tiny_checkpoint
from models.tokenizer import chat_prompt_ids, load_tokenizer

MESSAGES = [
    {"role": "system", "content": "Answer the question."},
    {"role": "user", "content": "What is the capital of Peru?"},
]


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_transformers_reads_it_as_we_do(tmp_path, model_type):
    folder = write_tiny_checkpoint(tmp_path / model_type, model_type=model_type)
    model, tokenizer = from_pretrained(folder, dtype=jnp.float32), load_tokenizer(folder)
    ids = chat_prompt_ids(tokenizer, MESSAGES)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    want_ids = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert ids == list(getattr(want_ids, "input_ids", want_ids))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert hf.config.model_type == model_type
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits.numpy()
    got = np.asarray(model(jnp.asarray([ids])))
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_command_writes_one_and_refuses_a_folder_in_use(tmp_path, capsys):
    assert cli.main(["models", "tiny", str(tmp_path / "tiny"), "--arch", "qwen3"]) == 0
    assert (tmp_path / "tiny" / "model.safetensors").is_file()
    assert "try it with --model" in capsys.readouterr().out
    assert cli.main(["models", "tiny", str(tmp_path / "tiny")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("tiny' is not empty: choose a new folder")


def test_exist_ok_returns_a_checkpoint_already_there_and_refuses_other_files(tmp_path):
    first = write_tiny_checkpoint(tmp_path / "tiny")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert write_tiny_checkpoint(tmp_path / "tiny", exist_ok=True) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty"):
        write_tiny_checkpoint(tmp_path / "other", exist_ok=True)
