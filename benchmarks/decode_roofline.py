"""How fast can one decode step be here? The weight matmuls of a model's decode step, nothing else.

A ceiling for `benchmarks/sampler.py`: every layer's q/k/v/o and gated-MLP matmuls over a batch
of one-token rows, scanned over the layers like the decoder, then the lm_head; no attention over
a cache, no norms, no rope, no sampling. Whatever a sampler does, its decode step cannot beat
this on the same machine, dtype and batch. Shapes come from a checkpoint's config (weights are
random: only their sizes matter). Prints ms a step, the tokens/s ceiling, and the weight bytes
streamed per second against a square matmul's GFLOP/s measured in the same run.

    .venv/bin/python benchmarks/decode_roofline.py [--model smollm2-135m --batch 16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from update_profile import square_matmul_gflops, timed  # benchmarks/ is this script's sys.path[0]

from models.fetch import resolve_model_path
from models.hf import checkpoint_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a registry name or a checkpoint")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cfg = checkpoint_config(resolve_model_path(args.model))
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    shapes = {
        "q": (d, cfg.num_heads * dh),
        "k": (d, cfg.num_kv_heads * dh),
        "v": (d, cfg.num_kv_heads * dh),
        "o": (cfg.num_heads * dh, d),
        "gate": (d, f),
        "up": (d, f),
        "down": (f, d),
    }
    keys = jax.random.split(jax.random.key(0), len(shapes) + 2)
    layers = {
        name: 0.02 * jax.random.normal(key, (cfg.num_layers, *shape))
        for key, (name, shape) in zip(keys, shapes.items(), strict=False)
    }
    head = 0.02 * jax.random.normal(keys[-2], (d, cfg.vocab_size))
    x = jax.random.normal(keys[-1], (args.batch, d))

    @jax.jit
    def decode_matmuls(x, layers, head):
        def layer(x, w):
            q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
            # stand-in for attention: something of the o-projection's input size
            mixed = q + jnp.repeat(k + v, cfg.num_heads // cfg.num_kv_heads, axis=-1)
            x = x + mixed @ w["o"]
            return x + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"], None

        x, _ = jax.lax.scan(layer, x, layers)
        return x @ head

    step_s = timed(decode_matmuls, x, layers, head, repeats=args.repeats)
    weights = sum(w.size for w in layers.values()) + head.size
    weight_bytes = 4 * weights  # float32
    flops = 2 * args.batch * weights  # one multiply-add per weight per row
    ceiling = args.batch / step_s
    print(f"model: {args.model}, {cfg.num_layers} layers, d {d}, float32, batch {args.batch}")
    print(f"decode-step matmuls: {step_s * 1e3:.1f} ms -> ceiling {ceiling:.0f} tokens/s")
    streamed = weight_bytes / step_s / 1e9
    print(f"weights streamed   : {streamed:.1f} GB/s of {weight_bytes / 1e6:.0f} MB a step")
    print(
        f"compute            : {flops / step_s / 1e9:.1f} GFLOP/s vs a 1024^3 matmul's "
        f"{square_matmul_gflops():.1f}"
    )


if __name__ == "__main__":
    main()
