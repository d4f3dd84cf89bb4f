"""Our jitted sampler vs HF transformers `generate` (PyTorch, CPU): a random checkpoint, or real
weights with --model.

Greedy, same prompts, same lengths, no EOS, both on float32 on this machine's CPU threads.
Prints tokens/s of each after warm-up, the ratio, and our compile time separately. With
--engine it also times the same prompts sent as concurrent requests through the continuous
engine (`ContinuousEngine`, the sampler of training runs, its pool `--slots` rows), against our
one `generate` call.

    .venv/bin/python benchmarks/sampler.py [--layers 8 --d-model 512 --batch 16 ...]
    .venv/bin/python benchmarks/sampler.py --model smollm2-135m --batch 16 --new 128
    .venv/bin/python benchmarks/sampler.py --model smollm2-135m --batch 8 --new 64 --engine
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from mmgrpo_jax.engines.base import Request, Sampling
from mmgrpo_jax.engines.continuous import ContinuousEngine
from mmgrpo_jax.sampler.generate import generate
from models.hf import from_pretrained, load_checkpoint
from models.tokenizer import chat_prompt_ids

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 + 30?",
    "Which organ pumps blood through the body?",
    "List three colours.",
    "Translate 'good morning' into Spanish.",
    "Tell me a fun fact about cats.",
    "Spell the word 'banana' backwards.",
]


def load_real(name_or_path: str):
    """Our model and HF's from one GGUF checkpoint (a registry name or a path), and the chat
    prompts of QUESTIONS in its template."""
    from models.fetch import resolve_model_path
    from models.gguf import find_gguf

    folder = resolve_model_path(name_or_path)
    model, tokenizer, _ = load_checkpoint(folder, dtype=jnp.float32)
    gguf = find_gguf(folder)
    if gguf is None:
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return model, hf.eval(), prompts


def write_checkpoint(directory: Path, args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=int(args.d_model * 2.6875),
        num_hidden_layers=args.layers,
        num_attention_heads=args.d_model // 64,
        num_key_value_heads=max(1, args.d_model // 128),
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def interleaved(first, second, repeats: int) -> tuple[list[float], list[float]]:
    """Alternate the two so that the noise of a shared machine hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, bucket in ((first, times[0]), (second, times[1])):
            start = time.perf_counter()
            fn()
            bucket.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", help="real weights: a registry name or checkpoint path")
    parser.add_argument("--engine", action="store_true", help="also time the continuous engine")
    parser.add_argument("--slots", type=int, default=64, help="the engine's pool rows")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    generated = args.batch * args.new

    if args.model:
        model, hf, chats = load_real(args.model)
        rows = [chats[i % len(chats)] for i in range(args.batch)]
        described = f"{args.model}: {model.config.num_layers} layers, d {model.config.hidden_size}"
    else:
        rng = np.random.default_rng(0)
        rows = rng.integers(0, args.vocab, (args.batch, args.prompt)).tolist()
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(Path(tmp), args)
            hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
            hf = hf.eval()
            model = from_pretrained(tmp, dtype=jnp.float32)
        described = f"llama d_model={args.d_model} layers={args.layers} vocab={args.vocab}"
    width = max(map(len, rows))
    padded = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])

    def ours():
        out = generate(model, rows, max_new_tokens=args.new, temperature=0)
        assert all(len(c.token_ids) == args.new for c in out)
        return out

    def theirs():
        with torch.no_grad():
            return hf.generate(
                padded,
                attention_mask=mask,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
            )

    engine = None
    if args.engine:  # no stop token: every request decodes --new tokens, as above
        engine = ContinuousEngine(model, stop_token_ids=[], slots=args.slots, max_wait_s=0.05)

    def through_engine():
        sampling = Sampling(max_new_tokens=args.new, temperature=0.0)
        futures = [engine.submit(Request(tuple(r), sampling)) for r in rows]
        out = [f.result() for f in futures]
        assert all(len(c.token_ids) == args.new for c in out)
        return out

    start = time.perf_counter()
    first = ours()
    first_call = time.perf_counter() - start
    theirs()  # warm-up
    ours_times, theirs_times = interleaved(ours, theirs, args.repeats)
    ours_s, theirs_s = float(np.median(ours_times)), float(np.median(theirs_times))
    ratios = sorted(t / o for o, t in zip(ours_times, theirs_times, strict=True))
    hf_tokens = theirs()[:, width:].numpy()
    agree = np.mean([c.token_ids == hf_tokens[i].tolist() for i, c in enumerate(first)])

    print(f"model: {described}, float32")
    lengths = sorted({len(r) for r in rows})
    print(
        f"work: batch {args.batch}, prompts of {lengths[0]}-{lengths[-1]} + {args.new} new "
        "tokens, greedy"
    )
    print(
        f"devices: jax {jax.devices()[0].platform} x{jax.device_count()}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"ours    : {generated / ours_s:9.1f} tokens/s  (median {ours_s:.3f} s of {args.repeats})"
    )
    print(f"HF      : {generated / theirs_s:9.1f} tokens/s  (median {theirs_s:.3f} s)")
    print(
        f"ratio   : {theirs_s / ours_s:9.2f} x HF (median; paired runs "
        f"{ratios[0]:.2f} to {ratios[-1]:.2f})"
    )
    print(
        f"compile : {first_call - ours_s:9.2f} s (first call {first_call:.2f} s minus a warm call)"
    )
    print(f"greedy rows identical to HF: {agree:.0%}")
    if engine is not None:
        through_engine()  # warm-up: compiles the pool's passes
        engine_times, generate_times = interleaved(through_engine, ours, args.repeats)
        engine_s, generate_s = float(np.median(engine_times)), float(np.median(generate_times))
        pairs = zip(through_engine(), first, strict=True)
        same = np.mean([a.token_ids == b.token_ids for a, b in pairs])
        print(
            f"engine  : {generated / engine_s:9.1f} tokens/s  ({args.batch} concurrent requests, "
            f"pool of {engine.max_batch} rows; median {engine_s:.3f} s)"
        )
        print(
            f"engine / generate: {generate_s / engine_s:.2f}x (generate re-timed beside it: "
            f"{generated / generate_s:.1f} tokens/s); greedy rows identical: {same:.0%}"
        )
        engine.close()


if __name__ == "__main__":
    main()
