"""The checks for a lent GPU, in one run and one table, at the paper's Qwen3-8B shape (random bf16
weights, the memory settings of experiments/configs/hover_qwen3_8b.yaml):

1. `mmgrpo plan`'s train-step and sampler bytes against the measured peak
   (`memory_stats()["peak_bytes_in_use"]`, after the train steps and again after sampling);
2. the train step on 8 packed 8,192-token rows: tokens/s and MFU (6 x parameters FLOPs per token,
   attention excluded, against --peak-tflops);
3. the sampler's decode at batch 48: tokens/s and the share of HBM bandwidth (weights + KV cache
   read per step, against --peak-tbps);
4. three mmGRPO steps end to end on the two-door program (module-level grouping, LoRA), whose
   random policy mostly writes unparseable text: the point is that every stage runs at this shape.

    bash benchmarks/gpu_suite.sh                 # on the GPU machine (under 8 minutes on an H200)
    PYTHONPATH=. python benchmarks/gpu_suite.py --preset tiny   # the same on CPU in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmgrpo_jax.config_files import build_config, config_tree
from mmgrpo_jax.rl.batch import PackShape, Row, pack_rows
from mmgrpo_jax.rl.step import make_train_step, split_for_training
from mmgrpo_jax.sampler.generate import generate, request_slots
from mmgrpo_jax.trainer.config import MMGRPOConfig
from mmgrpo_jax.trainer.mmgrpo import MMGRPO
from mmgrpo_jax.trainer.plan import plan_memory
from models.config import ModelConfig
from models.decoder import Decoder
from models.tokenizer import train_bpe_tokenizer
from programs.synthetic import TwoDoors, two_door_examples, two_door_metric

CONFIG = "experiments/configs/hover_qwen3_8b.yaml"


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: ModelConfig
    overrides: dict[str, Any]  # on the config's mmgrpo section
    row_tokens: int  # packed training rows are this long (several per sequence)
    decode_prompt: int  # the sampler check's prompt and new tokens
    decode_new: int
    e2e_new: int  # completion bound of the end-to-end steps


PRESETS = {
    "qwen3-8b": Sizes(ModelConfig.qwen3_8b(), {}, 2048, 1024, 256, 128),
    "tiny": Sizes(
        ModelConfig.tiny(512, hidden_size=64, num_layers=2, model_type="qwen3"),
        {
            "optim": {"micro_batch_size": 2},
            "sampler": {"max_prompt_tokens": 224, "max_completion_tokens": 32, "batch": 6},
            "memory": {
                "attention_block": 32,
                "logits_chunk": 32,
                "prefill_chunk": 32,
                "pack_length": 256,
            },
        },
        32,
        32,
        8,
        8,
    ),
}


def load_config(sizes: Sizes) -> MMGRPOConfig:
    section = dict(config_tree(CONFIG)["mmgrpo"])
    section.pop("model_path")
    for key, value in sizes.overrides.items():
        section[key] = {**section.get(key, {}), **value}
    section.update(progress=False)
    return build_config(MMGRPOConfig, section, "mmgrpo.")


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def random_policy(cfg: MMGRPOConfig, model_cfg: ModelConfig) -> Decoder:
    return nnx.jit(
        lambda: Decoder(
            model_cfg,
            lora=cfg.lora,
            dtype=jnp.dtype(cfg.dtype),
            attention=cfg.memory.attention_config,
            remat=cfg.memory.remat,
            rngs=nnx.Rngs(0),
        )
    )()


def train_rows(cfg: MMGRPOConfig, sizes: Sizes, vocab: int) -> list[Row]:
    """Rows that fill micro_batch_size packed sequences: pack_length / row_tokens per sequence."""
    rng = np.random.default_rng(0)
    per_sequence = cfg.memory.pack_length // sizes.row_tokens
    completion = sizes.row_tokens // 4
    rows = []
    for _ in range(cfg.optim.micro_batch_size * per_sequence):
        ids = rng.integers(0, vocab, sizes.row_tokens).tolist()
        rows.append(Row(tuple(ids[:-completion]), tuple(ids[-completion:]), float(rng.normal())))
    return rows


def time_train_step(cfg: MMGRPOConfig, sizes: Sizes, model: Decoder) -> dict[str, float]:
    optimizer = cfg.optim.build(cfg.num_steps)
    graphdef, state, frozen = split_for_training(model, optimizer, cfg.trainable)
    step = make_train_step(
        graphdef, optimizer, cfg.resolved_loss, cfg.sampler.temperature, cfg.memory.logits_chunk
    )
    sequences = cfg.optim.micro_batch_size
    batch = pack_rows(
        train_rows(cfg, sizes, model.config.vocab_size),
        sequences,
        PackShape(sequences, cfg.memory.pack_length),
    )
    start = time.perf_counter()
    state, metrics = step(state, frozen, batch)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        state, metrics = step(state, frozen, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    tokens = float(np.asarray(batch.valid).sum())
    seconds = min(times)
    return {
        "compile_s": first - seconds,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
        "flops_per_s": 6 * model.config.num_params() * tokens / seconds,
        "padding": batch.padding_fraction,
        "loss": float(metrics["loss"]),
    }


def time_decode(cfg: MMGRPOConfig, sizes: Sizes, model: Decoder) -> dict[str, float]:
    mc, batch = model.config, cfg.sampler.batch
    rng = np.random.default_rng(1)
    prompts = rng.integers(0, mc.vocab_size, (batch, sizes.decode_prompt)).tolist()
    chunk = cfg.memory.prefill_chunk

    def run(new: int) -> float:
        start = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=new, temperature=1.0, prefill_chunk=chunk)
        assert all(len(c.token_ids) == new for c in out)
        return time.perf_counter() - start

    run(sizes.decode_new), run(1)  # compile both shapes
    total = min(run(sizes.decode_new) for _ in range(2))
    prefill = min(run(1) for _ in range(2))
    step = (total - prefill) / (sizes.decode_new - 1)
    slots = request_slots(sizes.decode_prompt, sizes.decode_new)
    itemsize = jnp.dtype(cfg.dtype).itemsize
    weights = itemsize * (mc.num_params() - mc.vocab_size * mc.hidden_size)  # embed: a gather
    kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * itemsize * batch * slots
    return {"step_s": step, "tokens_per_s": batch / step, "bytes_per_s": (weights + kv) / step}


def end_to_end(cfg: MMGRPOConfig, sizes: Sizes, model: Decoder) -> dict[str, float]:
    words = ["left", "right", "door", "open", "closed", "answer"]
    tokenizer = train_bpe_tokenizer([" ".join(words)] * 20, 300, "chatml")
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    with tempfile.TemporaryDirectory() as run_dir:
        e2e = dataclasses.replace(
            cfg,
            num_steps=3,
            num_rollouts=4,
            examples_per_step=2,
            eval_every=100,
            checkpoint_every=100,
            run_dir=run_dir,
            sampler=dataclasses.replace(cfg.sampler, max_completion_tokens=sizes.e2e_new),
            loss=dataclasses.replace(cfg.loss, max_completion_length=None),
        )
        optimizer = MMGRPO(
            two_door_metric, e2e, model=model, tokenizer=tokenizer, stop_token_ids=stop
        )
        start = time.perf_counter()
        optimizer.compile(TwoDoors(), two_door_examples(), [])
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": float(optimizer.summary["steps"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="H200 bf16 dense")
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="H200 HBM")
    parser.add_argument("--device-memory-gb", type=float, default=141.0)
    args = parser.parse_args()
    sizes = PRESETS[args.preset]
    cfg = load_config(sizes)
    print(f"devices: {jax.devices()}; config: {CONFIG} mmgrpo section, preset {args.preset}")
    started = time.perf_counter()
    plan = plan_memory(cfg, sizes.model, int(args.device_memory_gb * 1e9), model_name=args.preset)
    print(plan.table(), flush=True)
    model = random_policy(cfg, sizes.model)
    train = time_train_step(cfg, sizes, model)
    train_peak = peak_bytes()
    decode = time_decode(cfg, sizes, model)
    sampler_peak = peak_bytes()
    e2e = end_to_end(cfg, sizes, model)

    def gb(x):
        return "n/a (no memory_stats)" if x is None else f"{x / 1e9:.1f}"

    rows = [
        ("plan: train step (GB)", f"{plan.train_step_bytes / 1e9:.1f}"),
        ("measured peak after the train steps (GB)", gb(train_peak)),
        ("plan: sampler (GB)", f"{plan.sampler_bytes / 1e9:.1f}"),
        ("measured peak after sampling too (GB)", gb(sampler_peak)),
        (f"train step: {plan.shapes['train micro-batch']}, s", f"{train['step_s']:.2f}"),
        (
            "train tokens/s (padding share)",
            f"{train['tokens_per_s']:,.0f} ({train['padding']:.0%})",
        ),
        (
            "train MFU (6 N FLOPs per token)",
            f"{train['flops_per_s'] / 1e12 / args.peak_tflops:.1%}",
        ),
        ("train step compile, s", f"{train['compile_s']:.1f}"),
        (f"decode at batch {cfg.sampler.batch}: tokens/s", f"{decode['tokens_per_s']:,.0f}"),
        ("decode HBM bandwidth share", f"{decode['bytes_per_s'] / 1e12 / args.peak_tbps:.1%}"),
        (f"mmGRPO end to end: {e2e['steps']:.0f} steps, s", f"{e2e['seconds']:.1f}"),
        ("suite wall time, s", f"{time.perf_counter() - started:.0f}"),
    ]
    print("\n| check | value |\n| --- | ---: |")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
