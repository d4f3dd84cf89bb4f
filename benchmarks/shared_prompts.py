"""One LoRA GRPO update on real weights in four row layouts: padded (`memory.pack false`),
packed apart (`share_prompts false`), a prefix tree in the sequences of the old hand-set
`pack_length`, and the default (the prefix tree in the shape `pack_shape` chooses from the rows),
each timed interleaved against padded in one run.

The rows are one capitals step (update_profile.py's: 4 questions x `--rollouts` x 2 modules,
real prompts, random replies; `--chat-adapter` renders the prompts as DSPy's ChatAdapter does,
about 2.3x longer). `--layouts` picks which of the three are timed against padded. A
module-level group's calls of the country module share their prompt exactly; the capital
module's share theirs only when the rollouts named the same country. `--distinct-capitals`
makes every capital prompt differ (the worst case for sharing): the rows as built are the best
case, where all rollouts of a question agree.

    .venv/bin/python benchmarks/shared_prompts.py [--model smollm2-135m --repeats 3]
    .venv/bin/python benchmarks/shared_prompts.py --rollouts 8 --chat-adapter --repeats 1 \
        --layouts apart tree
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from sampler import interleaved  # benchmarks/ is this script's sys.path[0]
from update_profile import rows_of_one_step

from mmgrpo_jax.rl.batch import Batch, PackShape, pack_rows, pack_shape
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.rl.step import make_train_step, split_for_training
from mmgrpo_jax.trainer.config import OptimConfig
from models.hf import load_checkpoint
from models.lora import LoRAConfig

LAYOUTS = {"apart": "packed apart", "tree-hand": "tree, hand", "tree": "tree, default"}


def distinct_capitals(rows: list, tokenizer) -> list:
    """Each capital call's prompt made unique (a rollout-specific word before the country)."""
    out = []
    for k, row in enumerate(rows):
        if k % 2:  # rows alternate country, capital
            extra = tuple(tokenizer.encode(f" variant{k}", add_special_tokens=False))
            row = dataclasses.replace(
                row, prompt_ids=row.prompt_ids[:-8] + extra + row.prompt_ids[-8:]
            )
        out.append(row)
    return out


def describe(name: str, batch: Batch) -> str:
    positions = int(np.prod(batch.tokens.shape))
    real = int(np.asarray(batch.valid).sum())
    shape = "x".join(map(str, batch.tokens.shape))
    return f"{name:>14}: {shape:>10} = {positions:5d} positions, {real:5d} real tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--micro-batch", type=int, default=8, help="padded rows a micro-batch")
    parser.add_argument("--sequences", type=int, default=2, help="packed sequences a micro-batch")
    parser.add_argument("--pack-length", type=int, default=256)
    parser.add_argument("--distinct-capitals", action="store_true")
    parser.add_argument("--rollouts", type=int, default=4, help="of each of the 4 questions")
    parser.add_argument("--chat-adapter", action="store_true", help="DSPy ChatAdapter prompts")
    parser.add_argument(
        "--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="vs padded"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lora = LoRAConfig(rank=8, alpha=16.0)
    model, tokenizer, _ = load_checkpoint(args.model, dtype=jnp.float32, lora=lora)
    rng = np.random.default_rng(0)
    rows = rows_of_one_step(tokenizer, rng, args.rollouts, args.chat_adapter)
    if args.distinct_capitals:
        rows = distinct_capitals(rows, tokenizer)
    hand = PackShape(args.sequences, args.pack_length)
    auto = pack_shape(rows, args.micro_batch)
    batches = {
        "padded": pack_rows(rows, args.micro_batch),
        "packed apart": pack_rows(
            rows, args.micro_batch, pack_shape(rows, args.micro_batch, 0, False)
        ),
        "tree, hand": pack_rows(rows, args.sequences, hand, share_prompts=True),
        "tree, default": pack_rows(rows, args.micro_batch, auto, share_prompts=True),
    }
    optimizer = OptimConfig(lr=5e-4).build(10)
    graphdef, state, frozen = split_for_training(model, optimizer)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo", beta=0.04), 0.7)

    def runner(batch: Batch):
        def run() -> float:  # the step donates its state: run it on a copy
            _, metrics = step(jax.tree.map(jnp.copy, state), frozen, batch)
            return float(metrics["loss"])

        return run

    losses = {name: runner(batch)() for name, batch in batches.items()}  # compile and warm
    prompts = "DSPy ChatAdapter" if args.chat_adapter else "bare"
    print(
        f"model: {args.model}, LoRA r{lora.rank}, float32; {len(rows)} rows of one capitals "
        f"step (4 questions x {args.rollouts} rollouts x 2 modules, {prompts} prompts)"
    )
    for name, batch in batches.items():
        print(f"{describe(name, batch)}, loss {losses[name]:+.6f}")
    padded = runner(batches["padded"])
    for name in (LAYOUTS[key] for key in args.layouts):
        base, other = interleaved(padded, runner(batches[name]), args.repeats)
        ratio = np.median(base) / np.median(other)
        paired = np.asarray(base) / np.asarray(other)
        print(
            f"update, padded {np.median(base):6.2f} s vs {name} {np.median(other):6.2f} s: "
            f"{ratio:.2f}x (paired {paired.min():.2f}-{paired.max():.2f})"
        )


if __name__ == "__main__":
    main()
