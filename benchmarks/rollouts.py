"""Rollout throughput of a multi-module program: the continuous engine vs the static batcher.

A HoVer-shaped program (`programs.hover.HoverMultiHop`: per hop a query writer and a note taker,
prompts that grow with the notes) runs through `run_rollouts` on a random policy with a scripted
retriever. Completion lengths are mixed: every call draws its token budget from
[--min-new, --max-new] by a hash of its prompt (a random policy seldom samples a stop token, so
the budget is the length), the same for both engines. The sampled text is replaced by a
well-formed reply so every rollout runs all its hops; the sampling work is the policy's. Steps
alternate between the engines (after one warm-up step each) so a shared machine's noise hits
both alike. Prints the config, tokens/s and seconds per step of each, and the ratio.

    .venv/bin/python benchmarks/rollouts.py [--examples 4 --rollouts 8 --hops 3 ...]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import jax
import numpy as np

from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.continuous import ContinuousEngine
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.program import Example
from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.program.lm import LMOutput
from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.testing import tiny_decoder
from models.tokenizer import train_bpe_tokenizer
from programs.hover import HoverMultiHop, title_recall

WORDS = (
    "the",
    "film",
    "album",
    "river",
    "city",
    "band",
    "player",
    "born",
    "founded",
    "series",
    "county",
    "station",
    "novel",
    "directed",
    "written",
    "released",
    "american",
    "british",
    "french",
    "league",
    "season",
    "team",
    "song",
    "record",
    "school",
    "university",
    "museum",
    "church",
    "island",
    "company",
    "founder",
    "actor",
    "singer",
    "author",
    "war",
)


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class ShapedLM:
    """The engine's samples under well-formed replies, with a per-call token budget."""

    def __init__(self, lm: EngineLM, program: HoverMultiHop, min_new: int, max_new: int) -> None:
        self.lm, self.program = lm, program
        self.min_new, self.max_new = min_new, max_new

    def __call__(self, messages, **sampling) -> LMOutput:
        digest = hashlib.sha256(messages[-1]["content"].encode()).digest()
        budget = self.min_new + int.from_bytes(digest[:4], "little") % (
            self.max_new - self.min_new + 1
        )
        out = self.lm(messages, **{**sampling, "max_new_tokens": budget})
        rng = random.Random(digest)
        if "new_key_facts" in messages[0]["content"]:
            signature = self.program.take_notes.signature
            text = format_outputs(signature, {"new_key_facts": [sentence(rng, 6) for _ in "ab"]})
        else:
            text = format_outputs(self.program.write_query.signature, {"query": sentence(rng, 5)})
        return LMOutput(
            text=text,
            prompt_ids=out.prompt_ids,
            completion_ids=out.completion_ids,
            logprobs=out.logprobs,
            finish_reason=out.finish_reason,
        )

    # run_rollouts registers its rollouts with the engine
    def open_client(self) -> None:
        self.lm.open_client()

    def close_client(self) -> None:
        self.lm.close_client()

    @property
    def stats(self):
        return self.lm.stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--hops", type=int, default=3)
    parser.add_argument("--passages", type=int, default=3)
    parser.add_argument("--min-new", type=int, default=4)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compiles)")
    args = parser.parse_args()

    rng = random.Random(0)
    corpus = [sentence(rng, 12) for _ in range(2000)]
    tokenizer = train_bpe_tokenizer(corpus, args.vocab, "chatml")
    model = tiny_decoder(len(tokenizer), hidden_size=args.d_model, num_layers=args.layers)

    def retriever(query: str, k: int) -> list[str]:
        local = random.Random(query)
        return [f"{sentence(local, 2)} | {sentence(local, 20)}" for _ in range(k)]

    program = HoverMultiHop(retriever, hops=args.hops, k=args.passages)
    examples = [
        Example(claim=sentence(rng, 15), titles=[sentence(rng, 2)]).with_inputs("claim")
        for _ in range(args.examples)
    ]
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    slots = args.examples * args.rollouts
    engines = {
        "continuous": ContinuousEngine(
            model, stop_token_ids=stop, slots=slots, decode_steps=args.decode_steps
        ),
        "static": JaxEngine(model, stop_token_ids=stop, max_batch=slots),
    }
    sampling = Sampling(max_new_tokens=args.max_new, temperature=1.0)
    lms = {
        name: ShapedLM(
            EngineLM(engine, tokenizer, sampling=sampling), program, args.min_new, args.max_new
        )
        for name, engine in engines.items()
    }
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in engines}
    compiled: dict[str, int] = {}  # compiles before the timed steps
    for step in range(args.warmup + args.steps):
        for name, lm in lms.items():
            if step == args.warmup:
                compiled[name] = lm.stats.compiles
            before = lm.stats.tokens
            start = time.perf_counter()
            trajectories = run_rollouts(
                program,
                examples,
                title_recall,
                num_rollouts=args.rollouts,
                lm=lm,
                key_prefix=(step,),
            )
            seconds = time.perf_counter() - start
            failed = [t for t in trajectories if t.status != "ok"]
            if failed:
                raise RuntimeError(f"{name}: {len(failed)} rollouts failed: {failed[0].error}")
            if step >= args.warmup:
                results[name].append((seconds, lm.stats.tokens - before))
    calls = sum(len(t.calls) for t in trajectories)
    print(
        f"model: llama d_model={args.d_model} layers={args.layers} vocab={len(tokenizer)}, "
        f"float32, jax {jax.devices()[0].platform} x{jax.device_count()}"
    )
    print(
        f"program: HoverMultiHop hops={args.hops} k={args.passages}, {args.examples} examples x "
        f"{args.rollouts} rollouts = {slots} rollouts, {calls} calls a step; budgets "
        f"{args.min_new}-{args.max_new} new tokens; engines of {slots} rows, continuous "
        f"decode_steps={args.decode_steps}"
    )
    rates = {}
    for name, runs in results.items():
        seconds = np.array([s for s, _ in runs])
        tokens = np.array([t for _, t in runs])
        rates[name] = float(np.median(tokens / seconds))
        stats = engines[name].stats
        print(
            f"{name:10s}: {rates[name]:8.1f} tokens/s, {np.median(seconds):6.2f} s/step (medians "
            f"of {len(runs)} steps), occupancy {stats.occupancy:.2f}, mean queue wait "
            f"{stats.mean_queue_wait_s * 1e3:.0f} ms, compiles {stats.compiles or '-'} (in timed "
            f"steps {stats.compiles - compiled[name] if stats.compiles else '-'}), shared "
            f"prefix tokens {stats.shared_prefix_tokens}"
        )
    print(
        f"ratio     : {rates['continuous'] / rates['static']:8.2f} x the static batcher's tokens/s"
    )
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
