"""Tiny from-scratch policies for tests, the demo and the CPU experiments: nothing downloads."""

from __future__ import annotations

from collections.abc import Sequence

from flax import nnx
from transformers import PreTrainedTokenizerFast

from models.config import ModelConfig
from models.decoder import Decoder
from models.lora import LoRAConfig
from models.tokenizer import build_word_tokenizer


def tiny_decoder(
    vocab_size: int,
    *,
    hidden_size: int = 32,
    num_layers: int = 1,
    lora: LoRAConfig | None = None,
    seed: int = 0,
) -> Decoder:
    """A randomly initialised `ModelConfig.tiny` decoder."""
    config = ModelConfig.tiny(vocab_size, hidden_size=hidden_size, num_layers=num_layers)
    return Decoder(config, lora=lora, rngs=nnx.Rngs(seed))


def word_policy(
    words: Sequence[str], *, hidden_size: int = 32, num_layers: int = 2, seed: int = 0
) -> tuple[Decoder, PreTrainedTokenizerFast]:
    """A from-scratch decoder over a word vocabulary (one token per word): the demo's policy."""
    tokenizer = build_word_tokenizer(list(words))
    model = tiny_decoder(
        len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, seed=seed
    )
    return model, tokenizer
