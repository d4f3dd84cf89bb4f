"""Tiny GGUF files written the way llama.cpp's converter writes them, from a random decoder."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tokenizers.pre_tokenizers import ByteLevel

from models.config import ModelConfig
from models.decoder import Decoder
from models.export import hf_tensors
from models.gguf import GLOBAL_NAMES, LAYER_NAMES

F32 = gguf.GGMLQuantizationType.F32
F32 = gguf.GGMLQuantizationType.F32
HF_TO_GGUF = {hf: name for name, hf in GLOBAL_NAMES.items()}
HF_LAYER_TO_GGUF = {hf: name for name, hf in LAYER_NAMES.items()}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# byte-level alphabet first, then the specials: vocab = 256 + 3
TOKENS = sorted(ByteLevel.alphabet()) + SPECIALS


def tiny_config(**kwargs) -> ModelConfig:
    fields = dict(
        model_type="llama",
        vocab_size=len(TOKENS),
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    return ModelConfig(**{**fields, **kwargs})


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (halves -> adjacent pairs)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{HF_LAYER_TO_GGUF[rest]}"


def write_gguf(
    model: Decoder,
    path: Path,
    quant: gguf.GGMLQuantizationType = F32,
    architecture: str = "llama",
    tokenizer: bool = True,
) -> dict[str, np.ndarray]:
    """`model` as a GGUF at `path` (matrices in `quant`, norms in F32); returns the HF tensors
    a reader should get back: each matrix through quantize -> dequantize."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(TOKENS)
        writer.add_token_merges([])
        writer.add_token_types([1] * 256 + [3] * len(SPECIALS))
        writer.add_eos_token_id(TOKENS.index("<|im_end|>"))
        writer.add_bos_token_id(TOKENS.index("<|im_start|>"))
        writer.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    for hf, value in hf_tensors(model).items():
        value = np.asarray(value, np.float32)
        stored = value
        if hf.endswith("q_proj.weight"):
            stored = permute(value, cfg.num_heads)
        elif hf.endswith("k_proj.weight"):
            stored = permute(value, cfg.num_kv_heads)
        kind = quant if value.ndim == 2 else F32
        data = stored if kind == F32 else gguf.quants.quantize(stored, kind)
        writer.add_tensor(gguf_name(hf), data, raw_dtype=kind)
        round_trip = gguf.quants.dequantize(data, kind).reshape(value.shape)
        if hf.endswith(("q_proj.weight", "k_proj.weight")):  # back to HF's row order
            heads = cfg.num_heads if hf.endswith("q_proj.weight") else cfg.num_kv_heads
            round_trip = round_trip.reshape(heads, value.shape[0] // heads // 2, 2, -1)
            round_trip = round_trip.swapaxes(1, 2).reshape(value.shape)
        expected[hf] = np.asarray(round_trip, np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
