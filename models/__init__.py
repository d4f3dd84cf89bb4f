"""Policies: Flax NNX Llama 3.x / Qwen2 / Qwen3 decoders with LoRA, HF loading and export."""

from models.config import ModelConfig
from models.decoder import Decoder
from models.export import load_peft_adapter, merge_lora, save_merged, save_peft_adapter
from models.hf import from_pretrained, load_checkpoint
from models.lora import LoRAConfig
from models.sharding import make_mesh, shard_model
from models.tokenizer import chat_prompt_ids, load_tokenizer, stop_token_ids

__all__ = [
    "Decoder",
    "LoRAConfig",
    "ModelConfig",
    "chat_prompt_ids",
    "from_pretrained",
    "load_checkpoint",
    "load_peft_adapter",
    "load_tokenizer",
    "make_mesh",
    "merge_lora",
    "save_merged",
    "save_peft_adapter",
    "shard_model",
    "stop_token_ids",
]
