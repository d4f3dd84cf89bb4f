"""A small random Llama or Qwen3 checkpoint on disk, written by the project's own code (no torch):
every command that reads `model_path` can be tried with it, no weights downloaded.

The folder is an HF checkpoint transformers also loads: config.json, model.safetensors,
tokenizer files with the family's chat template (ChatML for Qwen3, Llama 3's for Llama) and
generation_config.json with the stop token. The tokenizer is a byte-level BPE trained on
`texts` (by default the capitals program's questions and a few sentences), so prompts are short
and a tiny policy runs programs end to end in seconds. Its replies are random: it is for trying
the commands and for tests, not for results.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.decoder import Decoder
from models.export import save_merged
from models.tokenizer import train_bpe_tokenizer

FAMILIES = {"llama": "llama3", "qwen3": "chatml"}  # model_type -> chat template
DEFAULT_TEXT = (
    "Answer the question. Reply with the answer only. What is the capital of France? Paris. "
    "Name the country that the question asks about. Which city is the capital of Peru? Lima. "
    "Summarize the passage in one sentence. Write a search query for the claim. "
)


def write_tiny_checkpoint(
    directory: str | Path,
    *,
    model_type: str = "llama",
    vocab_size: int = 1000,
    hidden_size: int = 64,
    num_layers: int = 2,
    texts: Iterable[str] | None = None,
    seed: int = 0,
    exist_ok: bool = False,
) -> Path:
    """Write the checkpoint into `directory` (created; refused if it holds files already).
    `exist_ok`: a folder that already holds a checkpoint (its config.json) is returned as it
    is, so a script that writes one can run twice; it is not checked against the arguments."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {sorted(FAMILIES)}, got {model_type!r}")
    directory = Path(directory)
    if exist_ok and (directory / "config.json").is_file():
        return directory
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{str(directory)!r} is not empty: choose a new folder")
    corpus = list(texts) if texts is not None else [DEFAULT_TEXT] * 20
    tokenizer = train_bpe_tokenizer(corpus, vocab_size, FAMILIES[model_type])
    config = ModelConfig.tiny(
        len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, model_type=model_type
    )
    model = Decoder(config, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    save_merged(model, directory)
    tokenizer.save_pretrained(directory)
    stop = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": stop}))
    return directory
