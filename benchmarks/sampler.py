"""Our jitted sampler vs HF transformers `generate` (PyTorch, CPU) on one random checkpoint.

Greedy, same prompts, same lengths, no EOS, both on float32 on this machine's CPU threads.
Prints tokens/s of each after warm-up, the ratio, and our compile time separately.

    .venv/bin/python benchmarks/sampler.py [--layers 8 --d-model 512 --batch 16 ...]
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

from mmgrpo_jax.sampling import generate
from models.hf import from_pretrained


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
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    prompts = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.prompt))
    generated = args.batch * args.new

    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        model = from_pretrained(tmp, dtype=jnp.float32)

    def ours():
        out = generate(model, prompts.tolist(), max_new_tokens=args.new, temperature=0)
        assert all(len(c.token_ids) == args.new for c in out)
        return out

    def theirs():
        with torch.no_grad():
            return hf.generate(
                torch.tensor(prompts),
                attention_mask=torch.ones_like(torch.tensor(prompts)),
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                pad_token_id=0,
            )

    start = time.perf_counter()
    first = ours()
    first_call = time.perf_counter() - start
    theirs()  # warm-up
    ours_times, theirs_times = interleaved(ours, theirs, args.repeats)
    ours_s, theirs_s = float(np.median(ours_times)), float(np.median(theirs_times))
    ratios = sorted(t / o for o, t in zip(ours_times, theirs_times, strict=True))
    hf_tokens = theirs()[:, args.prompt :].numpy()
    agree = np.mean([c.token_ids == hf_tokens[i].tolist() for i, c in enumerate(first)])

    print(f"model: llama d_model={args.d_model} layers={args.layers} vocab={args.vocab}, float32")
    print(f"work: batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, greedy")
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


if __name__ == "__main__":
    main()
