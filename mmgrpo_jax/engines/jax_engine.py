"""The JAX rollout engine: a request batcher in front of the jitted sampler.

Rollout threads submit requests concurrently. One dispatcher thread waits until every registered
client (a running rollout) has a request queued, or `max_batch` requests are queued, or the
oldest has waited `max_wait_s`, then samples one batch per distinct sampling setting and resolves
each request's future. The engine holds its own split of the model (graphdef, trainable state,
the frozen rest): `update_weights` swaps the trainable part for a validated copy between
dispatches, so the trainer may donate its buffers and never shares a mutable model with this
thread. A request with a `key_path` samples from a key derived from (seed, *key_path); the rest
of a sampled dispatch draws from the next seed of a counter that `state_dict` saves, so a run is
reproducible and resumable either way. Rows of a batch are ordered by (example, rollout, call).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from mmgrpo_jax.engines.base import Completion, EngineStats, Request, Sampling, check_weights
from mmgrpo_jax.sampling import generate, path_key, row_keys
from models.decoder import Decoder


@dataclasses.dataclass
class _Pending:
    request: Request
    future: Future
    queued_at: float


class JaxEngine:
    """`RolloutEngine` over a local Decoder; thread-safe, batched."""

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
        rows x cache slots exceed it into several sampler calls (`sampling.generate`)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        if trainable is None:
            trainable = nnx.LoRAParam if model.lora is not None else nnx.Param
        graphdef, weights, rest = nnx.split(model, trainable, ...)
        # Fresh containers over the same (immutable) arrays: assigning into the model's
        # variables later changes nothing here; only update_weights does.
        self._graphdef = graphdef
        self._weights, self._rest = jax.tree.map(lambda x: x, (weights, rest))
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_batch, self.max_wait_s, self.mesh = max_batch, max_wait_s, mesh
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        if max_cache_tokens is not None and max_cache_tokens < 1:
            raise ValueError(f"max_cache_tokens must be >= 1 or None, got {max_cache_tokens}")
        self.max_cache_tokens = max_cache_tokens
        self._stats = EngineStats(max_batch=max_batch)
        self._seed = seed
        self._sampled_dispatches = 0
        self._pending: list[_Pending] = []
        self._clients = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._dispatch_loop, name="jax-engine", daemon=True)
        self._thread.start()

    # -- the engine protocol ---------------------------------------------------------------
    def submit(self, request: Request) -> Future[Completion]:
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("this JaxEngine is closed")
            self._pending.append(_Pending(request, future, time.monotonic()))
            self._cond.notify_all()
        return future

    def update_weights(self, params: nnx.State) -> None:
        check_weights(self._weights, params)
        # a copy (the trainer donates its own buffers) placed where the engine's weights are:
        # an engine built before the policy went onto a mesh keeps its own devices
        copied = jax.tree.map(
            lambda new, old: jax.device_put(new, old.sharding, may_alias=False),
            params,
            self._weights,
        )
        with self._cond:
            self._weights = copied

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"sampled_dispatches": self._sampled_dispatches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self._cond:
            self._sampled_dispatches = int(state["sampled_dispatches"])

    def open_client(self) -> None:
        with self._cond:
            self._clients += 1

    def close_client(self) -> None:
        with self._cond:
            self._clients -= 1
            self._cond.notify_all()  # the others may now all be waiting

    def close(self) -> None:
        """Stop: the batch being sampled finishes, requests still queued fail (a run that is
        interrupted must not wait for them)."""
        with self._cond:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cond.notify_all()
        for pending in dropped:
            pending.future.set_exception(RuntimeError("the JaxEngine was closed"))
        self._thread.join()

    # -- the dispatcher ------------------------------------------------------------------------
    def _ready(self) -> bool:
        if not self._pending:
            return False
        waited = time.monotonic() - self._pending[0].queued_at
        everyone_waiting = len(self._pending) >= max(self._clients, 1)
        return everyone_waiting or len(self._pending) >= self.max_batch or waited >= self.max_wait_s

    def _dispatch_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._ready():
                    self._cond.wait(timeout=self.max_wait_s / 4)
                if self._closed and not self._pending:
                    return
                settings = self._pending[0].request.sampling
                # Rows are sampled by position: order them by rollout, not by thread timing, so
                # a run is reproducible (and resumable) whenever batches are full.
                same = sorted(
                    (p for p in self._pending if p.request.sampling == settings),
                    key=lambda p: (p.request.order is None, p.request.order or (), p.queued_at),
                )
                batch = same[: self.max_batch]
                taken = {id(p) for p in batch}
                self._pending = [p for p in self._pending if id(p) not in taken]
                seed = self._seed * 1_000_003 + self._sampled_dispatches  # fresh stream per call
                unkeyed = any(p.request.key_path is None for p in batch)
                if settings.temperature > 0 and unkeyed:  # greedy batches draw nothing
                    self._sampled_dispatches += 1
                model = nnx.merge(self._graphdef, self._weights, self._rest)
            self._run(model, batch, settings, seed)

    def _keys(self, batch: list[_Pending], stream_seed: int) -> jax.Array:
        """One key per request: from its key path, else the dispatch's stream by position."""
        paths = [p.request.key_path for p in batch]
        stream = row_keys(stream_seed, len(batch))
        return jnp.stack(
            [
                stream[i] if path is None else path_key(self._seed, path)
                for i, path in enumerate(paths)
            ]
        )

    def _run(self, model: Decoder, batch: list[_Pending], settings: Sampling, seed: int) -> None:
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
                mesh=self.mesh,
                prefill_chunk=self.prefill_chunk,
                max_cache_tokens=self.max_cache_tokens,
            )
        except Exception as err:  # every waiting caller sees the failure; none hangs
            for pending in batch:
                pending.future.set_exception(err)
            return
        with self._cond:
            self._stats.dispatches += 1
            self._stats.requests += len(batch)
        for pending, completion in zip(batch, completions, strict=True):
            pending.future.set_result(completion)
