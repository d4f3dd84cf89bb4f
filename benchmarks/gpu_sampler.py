"""Sampler throughput on a lent GPU: a Qwen3-8B-shaped random bf16 policy, batch 64, 512 new tokens.

Reports tokens/s and the fraction of HBM bandwidth the decode loop reaches. Each decode step must
read every weight (the embedding only for the sampled rows) and the KV cache; our decode attends
over the whole preallocated cache, so both the bytes it reads and the bytes a length-aware kernel
would need are shown. Random weights: the text is noise, the timing is real (no EOS is set).

    PYTHONPATH=. python benchmarks/gpu_sampler.py            # on the GPU machine
    PYTHONPATH=. python benchmarks/gpu_sampler.py --preset tiny   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmgrpo_jax.sampler.generate import generate, request_slots
from models.config import ModelConfig
from models.decoder import Decoder

PRESETS = {
    "qwen3-8b": ModelConfig.qwen3_8b(),
    "tiny": ModelConfig.tiny(1024, hidden_size=128, num_layers=2, model_type="qwen3"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=512)
    parser.add_argument("--peak-tbps", type=float, default=4.8, help="HBM peak (H200: 4.8 TB/s)")
    args = parser.parse_args()
    cfg = PRESETS[args.preset]
    print(f"devices: {jax.devices()}")
    start = time.perf_counter()
    model = nnx.jit(lambda: Decoder(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))()
    jax.block_until_ready(nnx.state(model))
    print(f"init: {cfg.num_params() / 1e9:.2f} B params in {time.perf_counter() - start:.1f} s")
    prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.prompt))
    prompts = prompts.tolist()

    def run(new: int) -> float:
        start = time.perf_counter()
        out = generate(model, prompts, max_new_tokens=new, temperature=1.0, seed=1)
        assert all(len(c.token_ids) == new for c in out)
        return time.perf_counter() - start

    compile_and_run = run(args.new)
    run(1)  # compile the 1-token shape for the prefill estimate
    total = min(run(args.new) for _ in range(2))
    prefill = min(run(1) for _ in range(2))
    step = (total - prefill) / (args.new - 1)

    weight_bytes = 2 * (cfg.num_params() - cfg.vocab_size * cfg.hidden_size)  # embed: a gather
    slots = request_slots(args.prompt, args.new)  # the sampler's own buckets
    kv_per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * args.batch
    kv_read = kv_per_slot * slots
    kv_needed = kv_per_slot * (args.prompt + args.new / 2)  # mean filled length
    peak = args.peak_tbps * 1e12
    print(f"work: batch {args.batch}, {args.prompt} prompt + {args.new} new tokens, bf16")
    print(f"first call (compile + run): {compile_and_run:.1f} s")
    print(f"generate: {total:.2f} s, prefill {prefill:.3f} s, decode step {1e3 * step:.2f} ms")
    print(f"tokens/s: {args.batch * args.new / total:,.0f} (decode only {args.batch / step:,.0f})")
    print(
        f"bytes per step: weights {weight_bytes / 1e9:.2f} GB, KV read {kv_read / 1e9:.2f} GB "
        f"(a length-aware kernel: {kv_needed / 1e9:.2f} GB)"
    )
    print(
        f"HBM bandwidth: {(weight_bytes + kv_read) / step / peak:.1%} of {args.peak_tbps} TB/s "
        f"as read; {(weight_bytes + kv_needed) / step / peak:.1%} counting needed bytes only"
    )


if __name__ == "__main__":
    main()
