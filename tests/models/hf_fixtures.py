"""Tiny random HF checkpoints written by the tests themselves (torch is a test-only reference)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

VOCAB = 256
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.15,  # O(1) logits, so relative tolerances mean something
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so every band of the scaling is exercised
}

# name -> (config class, config kwargs, save kwargs, rewrite config.json in the old layout)
CHECKPOINTS = {
    "llama31": (
        transformers.LlamaConfig,
        {
            **COMMON,
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_SCALING,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        {},
        True,
    ),
    "llama32_tied": (
        transformers.LlamaConfig,
        {
            **COMMON,
            "rope_theta": 500000.0,
            "rope_scaling": LLAMA3_SCALING,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
        },
        {},
        False,
    ),
    "qwen3_tied": (
        transformers.Qwen3Config,
        {
            **COMMON,
            "head_dim": 32,
            "rope_theta": 1e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        {},
        False,
    ),
    "qwen3_sharded": (
        transformers.Qwen3Config,
        {
            **COMMON,
            "head_dim": 24,
            "rope_theta": 5e6,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        {"max_shard_size": "100KB"},
        False,
    ),
    "qwen2_bias": (
        transformers.Qwen2Config,
        {**COMMON, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
        {},
        False,
    ),
}


def to_old_layout(config_path: Path) -> None:
    """Rewrite rope_parameters as top-level rope_theta + rope_scaling (pre-transformers-5)."""
    hf = json.loads(config_path.read_text())
    rope = hf.pop("rope_parameters", None)
    if rope is not None:
        hf["rope_theta"] = rope.pop("rope_theta")
        hf["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    config_path.write_text(json.dumps(hf, indent=2))


def write_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    config_cls, kwargs, save_kwargs, old_layout = CHECKPOINTS[name]
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # HF zero-inits biases and ones-inits norms: make them matter
        for param_name, param in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True, **save_kwargs)
    if old_layout:
        to_old_layout(directory / "config.json")
    return directory


def load_hf(directory: Path) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    return model.eval()
