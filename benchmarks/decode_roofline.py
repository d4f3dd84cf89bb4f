"""How fast can one decode step be here? The weight matmuls of a model's decode step, nothing else,
in each weight format, and (with --sampler) how much of that ceiling our sampler reaches.

A ceiling for `benchmarks/sampler.py`: every layer's q/k/v/o and gated-MLP matmuls over a batch
of one-token rows, scanned over the layers like the decoder, then the lm_head; no attention over
a cache, no norms, no rope, no sampling. Whatever a sampler does, its decode step cannot beat
this on the same machine, format and batch. Shapes come from a checkpoint's config (weights are
random: only their sizes matter). Formats, each timed in the same run and set against float32:

* float32: the weights and activations a run uses on CPU (`dtype: float32`);
* bfloat16: weights and activations in bfloat16, as `dtype: bfloat16` runs the model;
* bf16-weights: bfloat16 weights converted to float32 at the matmul (half the bytes streamed);
* int8-weights: int8 weights with a float32 scale per output channel, converted at the matmul;
* int8-dynamic: those int8 weights against activations quantized to int8 per row at each matmul
  (W8A8), an int8 x int8 -> int32 dot: not a format the model has, the one whose dot is faster.

`--update-tokens N` also times the update's shape: the same matmuls over N token rows, forward
and backward to the activations (LoRA keeps the base weights frozen, so no weight gradient),
the work of one packed micro-batch. `--sampler` times `generate` on the real float32 weights at
each batch (greedy, `--new` tokens, prefill included) and prints the share of the float32
ceiling it reaches.

    .venv/bin/python benchmarks/decode_roofline.py [--model smollm2-135m --batch 16,32,64]
    .venv/bin/python benchmarks/decode_roofline.py --batch 32,64 --update-tokens 1024 --sampler
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
from update_profile import square_matmul_gflops, timed  # benchmarks/ is this script's sys.path[0]

from models.fetch import resolve_model_path
from models.hf import checkpoint_config

FORMATS = ("float32", "bfloat16", "bf16-weights", "int8-weights", "int8-dynamic")
BYTES = {"float32": 4, "bfloat16": 2, "bf16-weights": 2, "int8-weights": 1, "int8-dynamic": 1}


def stored(w: jax.Array, fmt: str) -> dict[str, jax.Array]:
    """A float32 weight [..., in, out] as `fmt` keeps it."""
    if fmt == "float32":
        return {"w": w}
    if fmt in ("bfloat16", "bf16-weights"):
        return {"w": w.astype(jnp.bfloat16)}
    scale = jnp.max(jnp.abs(w), axis=-2, keepdims=True) / 127.0  # per output channel
    return {"w": jnp.round(w / scale).astype(jnp.int8), "scale": scale}


def matmul(fmt: str) -> Callable[[jax.Array, dict[str, jax.Array]], jax.Array]:
    """x @ w for a weight stored as `fmt`, in the activations' dtype."""

    def apply(x: jax.Array, w: dict[str, jax.Array]) -> jax.Array:
        if fmt in ("float32", "bfloat16"):
            return x @ w["w"]
        if fmt == "int8-dynamic":
            x_scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0 + 1e-12
            x_int8 = jnp.round(x / x_scale).astype(jnp.int8)
            y = jax.lax.dot(x_int8, w["w"], preferred_element_type=jnp.int32)
            return y.astype(x.dtype) * x_scale * w["scale"][0]
        y = x @ w["w"].astype(x.dtype)
        return y * w["scale"][0] if "scale" in w else y

    return apply


def decode_matmuls(cfg, fmt: str):
    """The jitted weight matmuls of one step over [rows, d] activations."""
    mm = matmul(fmt)
    repeats = cfg.num_heads // cfg.num_kv_heads

    def step(x, layers, head):
        def layer(x, w):
            q, k, v = mm(x, w["q"]), mm(x, w["k"]), mm(x, w["v"])
            # stand-in for attention: something of the o-projection's input size
            mixed = q + jnp.repeat(k + v, repeats, axis=-1)
            x = x + mm(mixed, w["o"])
            return x + mm(jax.nn.silu(mm(x, w["gate"])) * mm(x, w["up"]), w["down"]), None

        x, _ = jax.lax.scan(layer, x, layers)
        return mm(x, head)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="a registry name or a checkpoint")
    parser.add_argument("--batch", default="16", help="decode rows, e.g. 32,64")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"of {FORMATS}")
    parser.add_argument("--update-tokens", type=int, default=0, help="also time the update shape")
    parser.add_argument("--sampler", action="store_true", help="time generate against it")
    parser.add_argument("--new", type=int, default=64, help="tokens generate decodes (--sampler)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    formats = args.formats.split(",")
    if unknown := sorted(set(formats) - set(FORMATS)):
        parser.error(f"--formats: {unknown} are not among {FORMATS}")
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
    weights = sum(w.size for w in layers.values()) + head.size
    print(f"model: {args.model}, {cfg.num_layers} layers, d {d}, {weights / 1e6:.0f} M weights")
    print(f"peer : a 1024^3 float32 matmul, {square_matmul_gflops():.1f} GFLOP/s")

    ceilings: dict[int, float] = {}
    work = [(f"decode, batch {b}", b, False) for b in batches]
    if args.update_tokens:
        work.append((f"update, {args.update_tokens} tokens fwd+bwd", args.update_tokens, True))
    for title, rows, backward in work:
        print(f"\n{title}")
        float32_s = None
        for fmt in formats:
            if backward and fmt == "int8-dynamic":
                print(f"  {fmt:13s}: a sampler format (its rounding has no gradient)")
                continue
            kept = jax.tree.map(lambda w, fmt=fmt: stored(w, fmt), layers)
            kept_head = stored(head, fmt)
            step = decode_matmuls(cfg, fmt)
            act = jnp.bfloat16 if fmt == "bfloat16" else jnp.float32
            x = jax.random.normal(keys[-1], (rows, d)).astype(act)
            if backward:

                def loss(x, kept, kept_head, step=step):
                    return jnp.sum(step(x, kept, kept_head).astype(jnp.float32))

                fn = jax.jit(jax.grad(loss))
            else:
                fn = jax.jit(step)
            seconds = timed(fn, x, kept, kept_head, repeats=args.repeats)
            float32_s = seconds if fmt == "float32" else float32_s
            flops = 2 * rows * weights * (2 if backward else 1)  # backward: dx only, one matmul
            line = (
                f"  {fmt:13s}: {seconds * 1e3:8.1f} ms  {flops / seconds / 1e9:6.1f} GFLOP/s  "
                f"{BYTES[fmt] * weights / seconds / 1e9:5.1f} GB/s of weights"
            )
            if not backward:
                line += f"  -> {rows / seconds:6.0f} tokens/s"
                if fmt == "float32":
                    ceilings[rows] = rows / seconds
            if float32_s is not None and fmt != "float32":
                line += f"  ({float32_s / seconds:.2f}x float32)"
            print(line)
    if args.sampler:
        sampler_share(args, ceilings)


def sampler_share(args: argparse.Namespace, ceilings: dict[int, float]) -> None:
    """Our `generate` on the real float32 weights at each batch, as a share of the ceiling: the
    whole call, and its decode steps alone (the call less a one-token call, which is the
    prefill and the first token)."""
    import time

    from mmgrpo_jax.sampler.generate import generate
    from models.hf import load_checkpoint
    from models.tokenizer import chat_prompt_ids

    model, tokenizer, _ = load_checkpoint(args.model, dtype=jnp.float32)
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Name a capital city."}])
    print(f"\nsampler: generate, greedy, {len(prompt)}-token prompts + {args.new} new (float32)")

    def seconds(prompts: list, new: int) -> float:
        generate(model, prompts, max_new_tokens=new, temperature=0.0)  # compile and warm
        times = []
        for _ in range(3):
            start = time.perf_counter()
            generate(model, prompts, max_new_tokens=new, temperature=0.0)
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    for rows, ceiling in ceilings.items():
        whole, first = seconds([prompt] * rows, args.new), seconds([prompt] * rows, 1)
        rate, decode = rows * args.new / whole, rows * (args.new - 1) / (whole - first)
        print(
            f"  batch {rows:3d}: {rate:6.0f} tokens/s = {rate / ceiling:.0%} of the float32 "
            f"ceiling ({ceiling:.0f}); decode steps alone {decode:.0f} = {decode / ceiling:.0%}"
        )


if __name__ == "__main__":
    main()
