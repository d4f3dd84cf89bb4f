"""One single-module GRPO step, ours (MMGRPO) vs TRL's GRPOTrainer, on the same weights.

By default both train every weight (full fine-tuning, float32, beta 0, one iteration) of the same
random Llama (d_model 256 x 4 layers) from the same 4 prompts x 8 generations of <= 32 new
tokens, on this machine's CPU (torch limited to --threads; JAX uses the same cores). With
`--model smollm2-135m` (or a GGUF folder) both train a LoRA adapter of rank --lora-rank on every
projection of the real weights instead (ours from the GGUF, TRL on transformers reading the same
GGUF with a PEFT LoraConfig), float32. TRL gets the
exact chat messages our program renders (`Predict("question -> answer", bare=True)`) and the same
reward on the completion text. The seconds per step come from the difference of a short and a
long run of each (--short and --long steps, every run in a fresh process), so loading, compiling
and set-up drop out. Ours also prints the median of its logged step times after the short run's
steps, split into rollouts and update (its train step compiles again for new packed shapes,
which the difference counts and a median mostly does not).

    .venv/bin/python benchmarks/train_step.py [--d-model 256 --layers 4 --short 2 --long 6]
    .venv/bin/python benchmarks/train_step.py --model smollm2-135m --short 1 --long 4

Needs the `bench` extra (trl) on top of `dev` (torch).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

from mmgrpo_jax.program import Example, Predict, adapter
from mmgrpo_jax.trainer.config import MMGRPOConfig, OptimConfig, ParallelConfig, SamplerConfig
from mmgrpo_jax.trainer.mmgrpo import MMGRPO
from models.fetch import resolve_model_path
from models.lora import TARGETS, LoRAConfig
from models.tokenizer import train_bpe_tokenizer

QUESTIONS = [
    "Which river flows through the city where the band was founded?",
    "Who directed the film that the novel's author wrote the script for?",
    "In which county is the station that opened the year the museum closed?",
    "What league did the team of the player born on the island join first?",
]


def reward_of(text: str) -> float:
    """A deterministic reward with spread across samples: the share of vowels in the text."""
    letters = [c for c in text.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def write_checkpoint(directory: Path, args: argparse.Namespace) -> None:
    rng = random.Random(0)
    words = " ".join(QUESTIONS).lower().replace("?", "").split()
    corpus = [" ".join(rng.choice(words) for _ in range(20)) for _ in range(500)] + QUESTIONS
    tokenizer = train_bpe_tokenizer(corpus, args.vocab, "chatml")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.d_model,
        intermediate_size=int(args.d_model * 2.6875),
        num_hidden_layers=args.layers,
        num_attention_heads=args.d_model // 64,
        num_key_value_heads=max(1, args.d_model // 128),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def program() -> Predict:
    return Predict("question -> answer", bare=True)


def ours(checkpoint: Path, steps: int, run_dir: Path, args) -> tuple[float, list[dict]]:
    config = MMGRPOConfig(
        grouping="module",
        num_rollouts=args.generations,
        examples_per_step=len(QUESTIONS),
        num_steps=steps,
        train="lora" if args.model else "full",
        lora=LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank),
        dtype="float32",
        model_path=str(checkpoint),
        run_dir=str(run_dir),
        progress=False,
        eval_every=10_000,
        checkpoint_every=10_000,
        optim=OptimConfig(lr=1e-5, micro_batch_size=len(QUESTIONS) * args.generations),
        sampler=SamplerConfig(max_completion_tokens=args.new, batch=32, engine=args.engine),
        parallel=ParallelConfig(devices=1),
    )
    trainset = [Example(question=q, answer="").with_inputs("question") for q in QUESTIONS]
    start = time.perf_counter()
    MMGRPO(lambda example, prediction: reward_of(prediction.answer), config).compile(
        program(), trainset
    )
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return seconds, [r for r in rows if "loss" in r]


def theirs(checkpoint: Path, steps: int, out_dir: Path, args) -> float:
    import datasets
    import trl

    prompts = [adapter.render(program().signature, {"question": q}, bare=True) for q in QUESTIONS]
    dataset = datasets.Dataset.from_list([{"prompt": p} for p in prompts])

    def reward(completions, **_):
        return [reward_of(c[0]["content"]) for c in completions]

    config = trl.GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=len(QUESTIONS) * args.generations,
        num_generations=args.generations,
        max_completion_length=args.new,
        max_steps=steps,
        learning_rate=1e-5,
        beta=0.0,
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_steps=10_000,
        dataloader_num_workers=0,
        seed=0,
    )
    start = time.perf_counter()
    model, extra = str(checkpoint), {}
    if args.model:  # the same GGUF, read by transformers; a PEFT LoRA of the same rank
        import peft

        gguf = next(checkpoint.glob("*.gguf"))
        read = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, gguf_file=gguf.name, dtype=torch.float32
        )
        # transformers marks a model read from a GGUF as quantized and refuses to train it: the
        # same (dequantized) weights in a plain model of the same config
        model_config = read.config
        del model_config.quantization_config
        model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        model.load_state_dict(read.state_dict(), strict=True)
        extra["processing_class"] = transformers.AutoTokenizer.from_pretrained(checkpoint)
        extra["peft_config"] = peft.LoraConfig(
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=list(TARGETS),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
    trainer = trl.GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, **extra
    )
    trainer.train()
    return time.perf_counter() - start


def in_fresh_process(which: str, checkpoint: Path, steps: int, out: Path, argv: list[str]) -> float:
    """Seconds of one run in its own process: no compile cache carries over between runs."""
    command = [sys.executable, __file__, *argv, "--run", which, "--run-steps", str(steps)]
    command += ["--checkpoint", str(checkpoint), "--out", str(out)]
    subprocess.run(command, check=True)
    return json.loads((out / "seconds.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--short", type=int, default=2)
    parser.add_argument("--long", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", default="continuous", choices=["continuous", "static"])
    parser.add_argument("--skip-trl", action="store_true", help="time ours only")
    parser.add_argument(
        "--model", help="real weights (smollm2-135m, a GGUF folder): LoRA instead of full"
    )
    parser.add_argument("--lora-rank", type=int, default=8, help="with --model")
    parser.add_argument("--run", choices=["ours", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--run-steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("mmgrpo_jax").setLevel(logging.WARNING)
    if args.run:  # one timed run, in a process of its own
        run = ours if args.run == "ours" else theirs
        out = run(args.checkpoint, args.run_steps, args.out, args)
        seconds = out[0] if isinstance(out, tuple) else out
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "seconds.json").write_text(json.dumps(seconds))
        return
    argv = [a for a in sys.argv[1:]]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.model:
            ckpt = resolve_model_path(args.model)
            if not ckpt.is_dir() or not any(ckpt.glob("*.gguf")):
                parser.error(f"--model {args.model!r}: not a folder holding a GGUF ({ckpt})")
        else:
            write_checkpoint(root / "ckpt", args)
            ckpt = root / "ckpt"
        ours_short = in_fresh_process("ours", ckpt, args.short, root / "ours_short", argv)
        ours_long = in_fresh_process("ours", ckpt, args.long, root / "ours_long", argv)
        rows = [
            json.loads(line)
            for line in (root / "ours_long" / "metrics.jsonl").read_text().splitlines()
        ]
        rows = [r for r in rows if "loss" in r]
        per_step = (ours_long - ours_short) / (args.long - args.short)
        steady = rows[args.short :]
        step_s = [r["time/rollout"] + r["time/train"] for r in steady]
        model = (
            f"{args.model} ({ckpt.name}), float32, LoRA rank {args.lora_rank} on "
            f"{len(TARGETS)} projections"
            if args.model
            else f"llama d_model={args.d_model} layers={args.layers} vocab={args.vocab}, "
            "float32, full fine-tuning"
        )
        print(
            f"model: {model}; {len(QUESTIONS)} prompts x {args.generations} "
            f"generations, <= {args.new} new tokens; jax {jax.devices()[0].platform}, torch "
            f"threads {torch.get_num_threads()}; ours samples with the {args.engine} engine"
        )
        print(
            f"ours    : {per_step:6.2f} s/step ({args.short} steps {ours_short:.1f} s, "
            f"{args.long} steps {ours_long:.1f} s); a step after the first {args.short}: "
            f"{np.median(step_s):.2f} s (median; rollouts "
            f"{np.median([r['time/rollout'] for r in steady]):.2f} s, update "
            f"{np.median([r['time/train'] for r in steady]):.2f} s, padding "
            f"{np.median([r['padding_fraction'] for r in steady]):.0%}, sampler compiles "
            f"{sum(r['perf/sampler_compiles'] for r in steady):.0f})"
        )
        if args.skip_trl:
            return
        theirs_short = in_fresh_process("trl", ckpt, args.short, root / "trl_short", argv)
        theirs_long = in_fresh_process("trl", ckpt, args.long, root / "trl_long", argv)
        trl_step = (theirs_long - theirs_short) / (args.long - args.short)
        print(
            f"TRL     : {trl_step:6.2f} s/step ({args.short} steps {theirs_short:.1f} s, "
            f"{args.long} steps {theirs_long:.1f} s)"
        )
        print(f"ratio   : {trl_step / per_step:6.2f} x TRL's speed (their s/step over ours)")


if __name__ == "__main__":
    main()
