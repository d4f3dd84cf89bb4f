"""Tiny from-scratch policies for tests, the demo and the CPU experiments: nothing downloads."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
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
    words: Sequence[str],
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    seed: int = 0,
    uniform_start: bool = True,
) -> tuple[Decoder, PreTrainedTokenizerFast]:
    """A from-scratch decoder over a word vocabulary (one token per word): the demo's policy.

    `uniform_start` zeroes the output head, so every seed starts from the uniform next-word
    distribution. A random head puts a seed-dependent bias on the replies that barely depends
    on the prompt: on the two-door program seed 2 gave the two door words 3.7% of the mass and
    the four answers 16%, so 99% of its trajectories failed to parse and its groups stayed flat
    for ~15 steps. The other weights stay random, so the gradient reaches them after one update.
    """
    tokenizer = build_word_tokenizer(list(words))
    model = tiny_decoder(len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    if uniform_start:
        if model.lm_head is None:
            raise ValueError("uniform_start needs an untied output head")
        model.lm_head.kernel[...] = jnp.zeros_like(model.lm_head.kernel[...])
    return model, tokenizer
