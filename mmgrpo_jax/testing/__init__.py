"""Helpers shared by the tests, the demo and the experiments: scripted LMs and tiny policies."""

from mmgrpo_jax.testing.scripted import Messages, ScriptedLM, word_prompt_model
from mmgrpo_jax.testing.tiny import tiny_decoder, word_policy

__all__ = ["Messages", "ScriptedLM", "tiny_decoder", "word_policy", "word_prompt_model"]
