"""What per-module adapters cost: one GRPO LoRA update and one greedy sampler call with a LoRA
adapter per module (stacked, each row its module's) against the shared adapter, same rows.

The rows are one capitals step (update_profile.py's: 16 rollouts x 2 modules, real prompts,
12-token replies) on SmolLM2-135M (or --model), float32, LoRA rank 8 on every projection. The
per-module model serves the country writer's rows on one adapter and the capital namer's on the
other, so every batch mixes them. Each pair is timed warm, interleaved (so a busy machine slows
both alike), median of --repeats; the ratio is per-module / shared.

    .venv/bin/python benchmarks/adapters.py [--model smollm2-135m --repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from sampler import interleaved
from update_profile import rows_of_one_step

from mmgrpo_jax.rl.batch import pack_rows
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.rl.step import make_train_step, split_for_training
from mmgrpo_jax.sampler.generate import generate
from mmgrpo_jax.trainer.config import OptimConfig
from models.hf import load_checkpoint
from models.lora import LoRAConfig

SHARED = LoRAConfig(rank=8, alpha=16.0)
PER_MODULE = dataclasses.replace(SHARED, modules=("country=country", "capital=capital"))


def medians(first, second, repeats: int) -> tuple[float, float]:
    """Medians of the two, alternated (sampler.py's `interleaved`) after one warm call each."""
    first(), second()
    times = interleaved(first, second, repeats)
    return float(np.median(times[0])), float(np.median(times[1]))


def update(model, rows, micro_batch: int, num_adapters: int):
    """A warm-able closure running one train step on copies of the state (it donates)."""
    optimizer = OptimConfig(lr=5e-4).build(10)
    graphdef, state, frozen = split_for_training(model, optimizer)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), 0.7)
    batch = pack_rows(rows, micro_batch, num_adapters=num_adapters)
    return lambda: jax.block_until_ready(step(jax.tree.map(jnp.copy, state), frozen, batch)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    shared, tokenizer, _ = load_checkpoint(args.model, dtype=jnp.float32, lora=SHARED)
    per_module, _, _ = load_checkpoint(args.model, dtype=jnp.float32, lora=PER_MODULE)
    rows = rows_of_one_step(tokenizer, np.random.default_rng(0))  # country, capital, ...
    mixed = [dataclasses.replace(r, adapter=i % 2) for i, r in enumerate(rows)]
    step_s = medians(
        update(shared, rows, args.micro_batch, 1),
        update(per_module, mixed, args.micro_batch, 2),
        args.repeats,
    )
    prompts = [r.prompt_ids for r in rows[:16]]
    ids = [r.adapter for r in mixed[:16]]
    settings = {"max_new_tokens": args.new_tokens, "temperature": 0.0, "eos_token_ids": ()}
    sample_s = medians(
        lambda: generate(shared, prompts, **settings),
        lambda: generate(per_module, prompts, adapter_ids=ids, **settings),
        args.repeats,
    )
    tokens = len(prompts) * args.new_tokens
    print(f"model: {args.model}, float32, LoRA r{SHARED.rank} on every projection, CPU")
    print("| what | shared adapter | per-module adapters (2, mixed) | per-module / shared |")
    print("| --- | --- | --- | --- |")
    print(
        f"| train step, {len(rows)} rows | {step_s[0]:.2f} s | {step_s[1]:.2f} s | "
        f"{step_s[1] / step_s[0]:.2f}x |"
    )
    print(
        f"| greedy generate, {len(prompts)} x {args.new_tokens} new tokens | "
        f"{tokens / sample_s[0]:.0f} tok/s | {tokens / sample_s[1]:.0f} tok/s | "
        f"{sample_s[1] / sample_s[0]:.2f}x (time) |"
    )


if __name__ == "__main__":
    main()
