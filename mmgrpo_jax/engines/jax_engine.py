"""The static JAX rollout engine: a request batcher in front of the jitted sampler.

Rollout threads submit requests concurrently. One dispatcher thread waits until every registered
client (a running rollout) has a request queued, or `max_batch` requests are queued, or the
oldest has waited `max_wait_s`, then samples one batch per distinct sampling setting, decodes it
until its longest row ends, and resolves each request's future. Rows of a batch are ordered by
(example, rollout, call); unkeyed rows of a sampled batch draw from one fresh seed of the
engine's stream. `ContinuousEngine` is the default; this one stays as its reference
(`sampler.engine=static`) and is what `mmgrpo plan` sizes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.local import LocalEngine, Pending, schedule_order
from mmgrpo_jax.sampler.generate import generate, path_key, row_keys
from models.decoder import Decoder


class JaxEngine(LocalEngine):
    """`RolloutEngine` over a local Decoder: static batches; thread-safe."""

    def __init__(
        self,
        model: Decoder,
        *,
        stop_token_ids: Sequence[int],
        trainable: Any = None,
        max_batch: int = 64,
        max_wait_s: float = 0.05,
        seed: int = 0,
        mesh: Mesh | None = None,
        prefill_chunk: int = 0,
        max_cache_tokens: int | None = None,
    ) -> None:
        """`trainable` filters the part `update_weights` replaces (default: the LoRA parameters
        of a model with an adapter, else every parameter); `prefill_chunk` > 0 prefills long
        prompts that many tokens at a time; `max_cache_tokens` splits a dispatch whose padded
        rows x cache slots exceed it into several sampler calls (`sampler.generate.generate`)."""
        super().__init__(
            model,
            stop_token_ids=stop_token_ids,
            trainable=trainable,
            max_batch=max_batch,
            max_wait_s=max_wait_s,
            seed=seed,
        )
        self.mesh = mesh
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if max_cache_tokens is not None and max_cache_tokens < 1:
            raise ValueError(f"max_cache_tokens must be >= 1 or None, got {max_cache_tokens}")
        self.max_cache_tokens = max_cache_tokens
        self._start()

    # -- the dispatcher ------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._batch_ready():
                    self._cond.wait(timeout=self.max_wait_s / 4)
                if self._closed and not self._pending:
                    return
                settings = self._pending[0].request.sampling
                same = sorted(
                    (p for p in self._pending if p.request.sampling == settings),
                    key=schedule_order,
                )
                batch = same[: self.max_batch]
                taken = {id(p) for p in batch}
                self._pending = [p for p in self._pending if id(p) not in taken]
                unkeyed = any(p.request.key_path is None for p in batch)
                # a fresh stream per sampled call; greedy batches draw nothing
                seed = self._stream_seed() if settings.temperature > 0 and unkeyed else 0
                model = nnx.merge(*self._model_states())
            self._run(model, batch, settings, seed)

    def _keys(self, batch: list[Pending], stream_seed: int) -> jax.Array:
        """One key per request: from its key path, else the dispatch's stream by position."""
        paths = [p.request.key_path for p in batch]
        stream = row_keys(stream_seed, len(batch))
        return jnp.stack(
            [
                stream[i] if path is None else path_key(self._seed, path)
                for i, path in enumerate(paths)
            ]
        )

    def _run(self, model: Decoder, batch: list[Pending], settings: Sampling, seed: int) -> None:
        started, dispatched = time.perf_counter(), time.monotonic()
        try:
            completions = generate(
                model,
                [p.request.prompt_ids for p in batch],
                max_new_tokens=settings.max_new_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                eos_token_ids=self.stop_token_ids,
                keys=self._keys(batch, seed),
                adapter_ids=[p.request.adapter for p in batch] if self.num_adapters > 1 else None,
                mesh=self.mesh,
                prefill_chunk=self.prefill_chunk,
                max_cache_tokens=self.max_cache_tokens,
            )
        except Exception as err:  # every waiting caller sees the failure; none hangs
            self._fail(batch, err)
            return
        with self._cond:
            self._stats.dispatches += 1
            self._stats.requests += len(batch)
            self._stats.tokens += sum(len(c.token_ids) for c in completions)
            self._stats.prompt_tokens += sum(len(p.request.prompt_ids) for p in batch)
            self._stats.sample_s += time.perf_counter() - started
            self._stats.queue_wait_s += sum(dispatched - p.queued_at for p in batch)
        for pending, completion in zip(batch, completions, strict=True):
            pending.future.set_result(completion)
