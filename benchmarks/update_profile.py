"""Where one LoRA GRPO update's time goes on real weights: body, lm_head, attention vs MLP, padding.

Builds the rows of one capitals step (4 questions x 4 rollouts x 2 modules, chat prompts of the
program's bare predictors, replies of ~12 tokens) on SmolLM2-135M, packs them as a run does, and
times on this machine, each jitted and warm (median of --repeats):

* the train step itself (forward, backward, AdamW) on the whole batch;
* the decoder body alone (forward and backward of its final hidden states, lm_head excluded);
* the lm_head and log-softmax alone (forward and backward, from the final hidden states at the
  completion targets, the only positions the step sends through it);

and prints the FLOPs of each (counted analytically), the split of the body into attention and
MLP, the GFLOP/s reached against a square matmul's on the same machine, and the share of token
positions that are padding or prompt (computed but never in the loss).

    .venv/bin/python benchmarks/update_profile.py [--model smollm2-135m --repeats 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmgrpo_jax.rl.batch import Row, pack_rows
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.rl.step import make_train_step, split_for_training, target_logprobs
from mmgrpo_jax.trainer.config import OptimConfig
from models.hf import load_checkpoint
from models.lora import LoRAConfig
from programs.capitals import Capitals, load_capitals


def rows_of_one_step(
    tokenizer, rng: np.random.Generator, rollouts: int = 4, chat_adapter: bool = False
) -> list[Row]:
    """4 questions x `rollouts` rollouts x 2 calls of the capitals program, module-level rows
    (each its own loss sequence): real prompts, random replies and the stop token. The prompts
    are the bare predictors' (12-token replies), or with `chat_adapter` what DSPy's ChatAdapter
    renders for the same two signatures (its headed field sections; 24-token replies, the
    length of its `[[ ## field ## ]]` reply with one short value)."""
    from mmgrpo_jax.program.adapter import render
    from models.tokenizer import chat_prompt_ids

    program = Capitals()
    prompt_of = render_chat_adapter if chat_adapter else lambda sig, x: render(sig, x, bare=True)
    rows = []
    for example in load_capitals(0).train[:4] * rollouts:
        for module, inputs in (
            (program.country, {"question": example.question}),
            (program.capital, {"country": example.country}),
        ):
            prompt = chat_prompt_ids(tokenizer, prompt_of(module.signature, inputs))
            reply = [*rng.integers(100, 40000, 24 if chat_adapter else 12).tolist(), 2]
            rows.append(
                Row(
                    prompt_ids=tuple(prompt),
                    completion_ids=tuple(reply),
                    advantage=float(rng.normal()),
                )
            )
    return rows


def render_chat_adapter(signature, inputs: dict[str, str]) -> list[dict[str, str]]:
    """The messages DSPy's ChatAdapter sends for one of our signatures (same fields and
    instruction), no demos."""
    import dspy

    names = [", ".join(f.name for f in fields) for fields in (signature.inputs, signature.outputs)]
    fields = " -> ".join(names)
    dspy_signature = dspy.Signature(fields, signature.instructions)
    return dspy.ChatAdapter().format(dspy_signature, demos=[], inputs=inputs)


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def square_matmul_gflops() -> float:
    """The peer every GFLOP/s here is set against: one warm 1024^3 float32 matmul."""
    square = jnp.ones((1024, 1024), jnp.float32)
    return 2 * 1024**3 / timed(jax.jit(lambda a: a @ a), square, repeats=10) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    lora = LoRAConfig(rank=8, alpha=16.0)
    model, tokenizer, _ = load_checkpoint(args.model, dtype=jnp.float32, lora=lora)
    cfg = model.config
    rows = rows_of_one_step(tokenizer, np.random.default_rng(0))
    batch = pack_rows(rows, args.micro_batch)
    optimizer = OptimConfig(lr=5e-4).build(10)
    graphdef, state, frozen = split_for_training(model, optimizer)
    step = make_train_step(graphdef, optimizer, LossConfig("grpo"), 0.7)

    def one_step(state, frozen, batch):
        new_state, metrics = step(state, frozen, batch)
        return new_state, metrics

    micro = jax.tree.map(lambda x: x[0], batch)  # one micro-batch, for the parts

    @jax.jit
    def body(trainable, frozen, micro):
        def loss(trainable):
            m = nnx.merge(graphdef, trainable, frozen.base)
            hidden = m.final_hidden(micro.tokens, micro.valid, micro.positions, micro.segments)
            return jnp.sum(hidden)

        return jax.grad(loss)(trainable)

    @jax.jit
    def head(trainable, frozen, hidden, targets):
        def loss(hidden):
            m = nnx.merge(graphdef, trainable, frozen.base)
            return jnp.sum(target_logprobs(m, hidden, targets, 0.7))

        return jax.grad(loss)(hidden)

    # the step's lm_head sees each row's completion targets only (Batch.target_index)
    targets = micro.target_tokens
    hidden = jnp.zeros((*targets.shape, cfg.hidden_size))
    # the step donates its state: time it on copies
    step_s = timed(lambda: one_step(jax.tree.map(jnp.copy, state), frozen, batch)[1]["loss"],
                   repeats=args.repeats)  # fmt: skip
    micro_batches = batch.tokens.shape[0]
    body_s = micro_batches * timed(body, state.trainable, frozen, micro, repeats=args.repeats)
    head_s = micro_batches * timed(
        head, state.trainable, frozen, hidden, targets, repeats=args.repeats
    )

    positions = int(np.prod(batch.tokens.shape))
    real = int(np.asarray(batch.valid).sum())
    in_loss = int(np.asarray(batch.loss_mask).sum())
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    attn_proj = d * dh * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * d * f
    length = batch.tokens.shape[-1]
    attn_scores = 2 * length * cfg.num_heads * dh  # q.k and p.v per query position, full rows
    per_token = attn_proj + attn_scores + mlp
    # Analytic, not XLA's cost analysis: that counts the scanned layer body once, not L times.
    # A LoRA backward computes activation gradients (as many FLOPs as the forward) but no
    # gradients of the frozen weights, so fwd + bwd is 2 x 2 FLOPs per multiply-add.
    body_f = 4 * positions * cfg.num_layers * per_token
    head_f = 4 * int(np.prod(batch.target_tokens.shape)) * d * cfg.vocab_size
    print(f"model: {args.model}, {cfg.num_layers} layers, d {d}, float32, LoRA r{lora.rank}")
    print(
        f"batch: {len(rows)} rows in {micro_batches} micro-batches of {batch.tokens.shape[1]} x "
        f"{length} positions = {positions}; {real} real tokens ({1 - real / positions:.0%} "
        f"padding), {in_loss} in the loss ({in_loss / positions:.0%} of positions)"
    )
    print(
        f"train step (fwd + bwd + AdamW): {step_s:7.2f} s  ({positions / step_s:.0f} positions/s)"
    )
    print(f"  decoder body fwd + bwd       : {body_s:7.2f} s  ({body_f / 1e12:.2f} TFLOP)")
    print(f"  lm_head + log-softmax fwd+bwd: {head_s:7.2f} s  ({head_f / 1e12:.2f} TFLOP)")
    print(
        f"  body split by analytic FLOPs : attention projections {attn_proj / per_token:.0%}, "
        f"attention scores {attn_scores / per_token:.0%}, MLP {mlp / per_token:.0%}"
    )
    achieved = (body_f + head_f) / max(body_s + head_s, 1e-9) / 1e9
    print(f"  achieved: {achieved:.1f} GFLOP/s over body + head")
    peak = square_matmul_gflops()
    print(f"  peer: a 1024^3 float32 matmul here: {peak:.1f} GFLOP/s ({achieved / peak:.0%} of it)")


if __name__ == "__main__":
    main()
