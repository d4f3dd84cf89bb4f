"""A tiny random Llama checkpoint with a BPE tokenizer trained on the paper tasks' own text.

Training the tokenizer on the rendered prompts keeps them short (a 77-label signature is a few
tokens), so the programs run end to end with a real EngineLM in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from mmgrpo_jax.program import adapter
from models.tokenizer import train_bpe_tokenizer
from programs import banking77, hover, papillon


def task_texts() -> list[str]:
    labels = banking77.label_names()
    programs = [
        banking77.Banking77(labels),
        papillon.Papillon(untrusted_lm=None),
        papillon.PapillonJudge(None),
        hover.HoverMultiHop(retriever=None),
    ]
    texts = []
    for program in programs:
        predictors = [program.quality, program.leakage] if hasattr(program, "quality") else None
        for predictor in predictors or program.predictors():
            inputs = {name: "x" for name in predictor.signature.input_names}
            texts += [m["content"] for m in adapter.render(predictor.signature, inputs)]
    texts += [e.text for e in banking77.load_banking77().train[:100]]
    texts += [e.user_query[:500] for e in papillon.load_pupa().train[:30]]
    texts += [e.claim for e in hover.load_hover().train[:100]]
    return texts * 3


def write_tiny_checkpoint(directory: Path, vocab_size: int = 2000) -> Path:
    tokenizer = train_bpe_tokenizer(task_texts(), vocab_size, "chatml")
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory
