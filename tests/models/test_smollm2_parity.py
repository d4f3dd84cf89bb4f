"""Parity on real weights: SmolLM2-135M-Instruct's GGUF, read by us and by transformers.

The model comes from the registry (`make model`, which `make test` runs first); without it these
tests skip, saying so. Transformers dequantizes the same file with its own code (torch), so the
GGUF name mapping, the q/k unpermutation, the tokenizer built from metadata and the decoder are
all checked against an independent reader.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

from mmgrpo_jax.sampler.generate import generate
from models.export import ADAPTER_WEIGHTS, save_peft_adapter
from models.fetch import fetched
from models.hf import load_checkpoint
from models.lora import LoRAConfig
from models.tokenizer import chat_prompt_ids

FOLDER = fetched("smollm2-135m")
pytestmark = pytest.mark.skipif(
    FOLDER is None, reason="smollm2-135m is not fetched: run `make model` (make test does)"
)

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": "You answer with a single keyword."},
        {"role": "user", "content": "Which organ pumps blood through the body?"},
    ],
    [{"role": "user", "content": "List three colours, separated by commas."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about cats, in one sentence."},
    ],
    [{"role": "user", "content": "Spell the word 'banana' backwards."}],
]
TEXTS = [
    "Hello world! It's 2026-12-02, and 123456 + 7.5% = ?",
    "  leading spaces\n\ttabs and\r\nnewlines   ",
    "naïve café, Straße, 日本語, emoji 🙂",
    "<|im_start|>user\ncode: def f(x): return x**2<|im_end|>",
]


@pytest.fixture(scope="module")
def ours():
    return load_checkpoint(FOLDER, dtype=jnp.float32)


@pytest.fixture(scope="module")
def theirs(tmp_path_factory):
    """Transformers reading the GGUF alone (not the tokenizer files the fetch wrote beside it)."""
    gguf = next(FOLDER.glob("*.gguf"))
    alone = tmp_path_factory.mktemp("gguf_alone")
    (alone / gguf.name).symlink_to(gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        alone, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(alone, gguf_file=gguf.name)
    return model, tokenizer


def hf_chat_ids(tokenizer, messages):
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompts_and_text_tokenize_as_transformers_does(ours, theirs):
    _, tokenizer, stop = ours
    _, hf_tokenizer = theirs
    for messages in CHATS:
        assert chat_prompt_ids(tokenizer, messages) == hf_chat_ids(hf_tokenizer, messages)
    for text in TEXTS:
        want = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == want, text
        assert tokenizer.decode(want) == hf_tokenizer.decode(want)
    assert stop == (hf_tokenizer.convert_tokens_to_ids("<|im_end|>"),)


def test_logits_within_2e_4_of_transformers_on_8_chats(ours, theirs):
    model, tokenizer, _ = ours
    hf_model, _ = theirs
    forward = nnx.jit(lambda m, ids: m(ids))
    worst, largest = 0.0, 0.0
    for messages in CHATS:
        ids = chat_prompt_ids(tokenizer, messages)
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits.numpy()[0]
        got = np.asarray(forward(model, jnp.asarray([ids])))[0]
        worst = max(worst, float(np.abs(got - want).max()))
        largest = max(largest, float(np.abs(want).max()))
    assert largest > 20  # real logits, not a degenerate model
    assert worst <= 2e-4, f"max |logit diff| {worst:.3g} over logits up to {largest:.1f}"


@pytest.mark.slow  # ~70 s: 64-token greedy decoding in both stacks; the logits above stay fast
def test_greedy_64_tokens_equal_hf_generate_stop_included(ours, theirs):
    model, tokenizer, stop = ours
    hf_model, _ = theirs
    prompts = [chat_prompt_ids(tokenizer, messages) for messages in CHATS]
    got = generate(model, prompts, max_new_tokens=64, temperature=0, eos_token_ids=stop)
    stopped = 0
    for prompt, completion in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=list(stop),
                pad_token_id=stop[0],
            )
        want = out[0, len(prompt) :].tolist()
        assert list(completion.token_ids) == want, tokenizer.decode(want)
        stopped += want[-1] in stop
    assert stopped >= 4  # most replies end at <|im_end|> within 64 tokens, and it is kept


def test_lora_gradient_has_peft_direction(ours, theirs, tmp_path):
    """One step's gradient of the reply tokens' mean NLL w.r.t. every LoRA factor (A and B,
    both nonzero so both receive gradient), against PEFT on the same rows (cosine >= 0.999)."""
    _, tokenizer, _ = ours
    lora = LoRAConfig(rank=8, alpha=16.0)
    model, _, _ = load_checkpoint(FOLDER, dtype=jnp.float32, lora=lora, lora_seed=1)
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    nnx.update(
        model,
        jax.tree.unflatten(
            tree,
            [
                0.02 * jax.random.normal(k, x.shape, x.dtype)
                for k, x in zip(keys, leaves, strict=True)
            ],
        ),
    )
    rows = [
        chat_prompt_ids(tokenizer, messages) + tokenizer(reply + "<|im_end|>")["input_ids"]
        for messages, reply in zip(CHATS[:4], ["Paris", "Waves fold", "42", "Heart"], strict=True)
    ]
    prompt_lens = [len(chat_prompt_ids(tokenizer, m)) for m in CHATS[:4]]
    width = max(map(len, rows))
    ids = np.array([r + [0] * (width - len(r)) for r in rows])
    reply = np.zeros_like(ids, bool)
    for i, (row, start) in enumerate(zip(rows, prompt_lens, strict=True)):
        reply[i, start : len(row)] = True
    targets, weights = ids[:, 1:], reply[:, 1:].astype(np.float32)

    graphdef, lora_state, base_state = nnx.split(model, nnx.LoRAParam, ...)

    def nll(lora_state):
        logits = nnx.merge(graphdef, lora_state, base_state)(jnp.asarray(ids[:, :-1]))
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
        picked = jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], -1)[..., 0]
        return -(picked * weights).sum() / weights.sum()

    grads = jax.grad(nll)(lora_state)
    adapter = save_peft_adapter(model, tmp_path / "adapter")
    nnx.update(model, grads)  # the gradient in the adapter's own layout, exported the same way
    ours_grad = load_file(save_peft_adapter(model, tmp_path / "grad") / ADAPTER_WEIGHTS)

    hf_model, _ = theirs
    peft_model = peft.PeftModel.from_pretrained(hf_model, adapter, is_trainable=True)
    try:
        logits = peft_model(torch.tensor(ids[:, :-1])).logits.float()
        logp = logits.log_softmax(-1).gather(-1, torch.tensor(targets)[..., None])[..., 0]
        loss = -(logp * torch.tensor(weights)).sum() / weights.sum()
        loss.backward()
        theirs_grad = {
            name.replace(".default", ""): p.grad.numpy()
            for name, p in peft_model.named_parameters()
            if p.requires_grad
        }
    finally:
        peft_model.unload()  # the shared HF model without the adapter for the other tests
    assert sorted(theirs_grad) == sorted(ours_grad)
    a = np.concatenate([ours_grad[k].ravel() for k in sorted(ours_grad)])
    b = np.concatenate([theirs_grad[k].ravel() for k in sorted(ours_grad)])
    cosine = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
    assert np.linalg.norm(b) > 0 and cosine >= 0.999, cosine
