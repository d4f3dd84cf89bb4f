"""Decoder configuration from an HF `config.json`, in the old and the transformers-5 layout."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked; the message names the file."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling (`rope_type: llama3`); None in ModelConfig means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; supported: {MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each head's queries and keys before RoPE."""
        return self.model_type == "qwen3"

    @property
    def attention_bias(self) -> bool:
        """Qwen2 has biases on the q, k and v projections."""
        return self.model_type == "qwen2"

    # -- presets -----------------------------------------------------------------------------
    @classmethod
    def tiny(
        cls,
        vocab_size: int,
        *,
        hidden_size: int = 32,
        num_layers: int = 1,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        model_type: str = "llama",
    ) -> ModelConfig:
        """A from-scratch toy decoder (MLP 2 x hidden) for tests, demos and CPU testbeds."""
        if hidden_size % num_heads:
            raise ValueError(
                f"hidden_size={hidden_size} is not a multiple of num_heads={num_heads}"
            )
        return cls(
            model_type=model_type,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=hidden_size // num_heads,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
        )

    @classmethod
    def qwen3_8b(cls) -> ModelConfig:
        """Qwen3-8B's shape (docs/design.md#scale), for plans and benchmarks without the weights."""
        return cls(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            max_position_embeddings=40960,
        )

    @classmethod
    def llama31_8b(cls) -> ModelConfig:
        """Llama-3.1-8B(-Instruct)'s shape, Llama-3 RoPE scaling included."""
        return cls(
            model_type="llama",
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            rope_theta=5e5,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
            max_position_embeddings=131072,
        )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From config.json: rope_theta + rope_scaling, or rope_parameters (transformers 5)."""
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; supported: {MODEL_TYPES}"
            )
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta"))
        if theta is None:
            raise ValueError("config.json has neither rope_theta nor rope_parameters.rope_theta")
        scaling_source = rope if rope.get("rope_type", "default") != "default" else legacy
        rope_type = scaling_source.get("rope_type", scaling_source.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(scaling_source["factor"]),
                low_freq_factor=float(scaling_source["low_freq_factor"]),
                high_freq_factor=float(scaling_source["high_freq_factor"]),
                original_max_position_embeddings=int(
                    scaling_source["original_max_position_embeddings"]
                ),
            )
        elif rope_type != "default":
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: default, llama3"
            )
        heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {str(path)!r}")
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{str(path)!r} is not valid JSON: {err}") from None
        except KeyError as err:
            raise CheckpointError(f"{str(path)!r} lacks the field {err}") from None
        except ValueError as err:  # our checks of the values (model_type, head counts, ...)
            raise CheckpointError(f"{str(path)!r}: {err}") from None

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict transformers loads (transformers-5 layout)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                **dataclasses.asdict(self.rope_scaling),
            }
        return {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "dtype": dtype,
        }

    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = d * self.head_dim * (self.num_heads * 2 + self.num_kv_heads * 2)
        per_layer = attn + 3 * d * f + 2 * d
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d


PRESETS = {"qwen3-8b": ModelConfig.qwen3_8b, "llama31-8b": ModelConfig.llama31_8b}


def preset(name: str) -> ModelConfig:
    """A named model shape (no weights): what a memory plan compiles without a checkpoint."""
    if name not in PRESETS:
        raise ValueError(f"model shape {name!r} is not a preset; presets: {sorted(PRESETS)}")
    return PRESETS[name]()


def rope_inv_freq(config: ModelConfig) -> list[float]:
    """Inverse frequencies, Llama-3 scaled when configured (docs/design.md#models)."""
    dim = config.head_dim
    inv = [1.0 / config.rope_theta ** (i / dim) for i in range(0, dim, 2)]
    s = config.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            scaled.append(f)
        elif wavelen > low_wavelen:
            scaled.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            scaled.append((1 - smooth) * f / s.factor + smooth * f)
    return scaled
