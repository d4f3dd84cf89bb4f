"""What every engine over a local Decoder shares: its own copy of the weights, the request
queue, the callers it waits for, the sampling keys, and a dispatcher thread.

The engine holds its own split of the model (graphdef, trainable state, the frozen rest):
`update_weights` swaps the trainable part for a validated copy between sampler calls, so the
trainer may donate its buffers and never shares a mutable model with the dispatcher. A request
with a `key_path` samples from a key derived from (seed, *key_path); the others draw from a
counter of the engine's own that `state_dict` saves, so a run is reproducible and resumable
either way. Subclasses write `_dispatch_loop`: the static batcher (`JaxEngine`) and the
continuous one (`ContinuousEngine`).
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
import numpy as np
from flax import nnx

from mmgrpo_jax.engines.base import EngineStats, Request
from mmgrpo_jax.sampler.generate import path_key, row_keys
from models.decoder import Decoder


@dataclasses.dataclass
class Pending:
    request: Request
    future: Future
    queued_at: float


def schedule_order(pending: Pending) -> tuple:
    """Rows by (example, rollout, call), not by thread timing: the same run schedules alike."""
    request = pending.request
    return (request.order is None, request.order or (), pending.queued_at)


class LocalEngine:
    """The common part of the `RolloutEngine`s over a local Decoder; thread-safe."""

    def __init__(
        self,
        model: Decoder,
        *,
        stop_token_ids: Sequence[int],
        trainable: Any,
        max_batch: int,
        max_wait_s: float,
        seed: int,
    ) -> None:
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
        self.model_config = model.config
        self.num_adapters = 1 if model.lora is None else model.lora.num_adapters
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_batch, self.max_wait_s = max_batch, max_wait_s
        self._stats = EngineStats(max_batch=max_batch)
        self._seed = seed
        self._sampled_dispatches = 0  # draws of the unkeyed stream so far
        self._weights_version = 0  # update_weights calls so far
        self._pending: list[Pending] = []
        self._clients = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._dispatch_loop, name="jax-engine", daemon=True)

    def _start(self) -> None:
        """Subclasses call this last in their __init__."""
        self._thread.start()

    # -- the engine protocol ---------------------------------------------------------------
    def submit(self, request: Request) -> Future:
        if not 0 <= request.adapter < self.num_adapters:
            raise ValueError(
                f"request for adapter {request.adapter}; this engine's model has "
                f"{self.num_adapters} adapter(s)"
            )
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"this {type(self).__name__} is closed")
            self._pending.append(Pending(request, future, time.monotonic()))
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
            self._weights_version += 1

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
        """Stop: requests not yet answered fail (a run that is interrupted must not wait)."""
        with self._cond:
            self._closed = True
            dropped, self._pending = self._pending, []
            self._cond.notify_all()
        self._fail(dropped, RuntimeError(f"the {type(self).__name__} was closed"))
        self._thread.join()

    # -- for the dispatchers ---------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        raise NotImplementedError

    def _batch_ready(self) -> bool:
        """A batch may start: every registered caller waits, or max_batch requests are queued,
        or the oldest has waited max_wait_s. Call under the lock."""
        if not self._pending:
            return False
        waited = time.monotonic() - self._pending[0].queued_at
        everyone_waiting = len(self._pending) >= max(self._clients, 1)
        return everyone_waiting or len(self._pending) >= self.max_batch or waited >= self.max_wait_s

    def _stream_seed(self) -> int:
        """The next seed of the unkeyed stream (advances it). Call under the lock."""
        seed = self._seed * 1_000_003 + self._sampled_dispatches
        self._sampled_dispatches += 1
        return seed

    def _request_key(self, request: Request) -> jax.Array:
        """A request's own key: from its key path, else the next draw of the stream (greedy
        requests draw nothing). Call under the lock."""
        if request.key_path is not None:
            return path_key(self._seed, request.key_path)
        seed = self._stream_seed() if request.sampling.temperature > 0 else 0
        return row_keys(seed, 1)[0]

    def _model_states(self) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
        """The weights a sampler call uses. Call under the lock."""
        return self._graphdef, self._weights, self._rest

    @staticmethod
    def _fail(pending: Sequence[Pending], err: BaseException) -> None:
        for p in pending:
            if not p.future.done():
                p.future.set_exception(err)


def check_weights(current: nnx.State, new: nnx.State) -> None:
    """Raise a ValueError naming the first path whose presence, shape or dtype differs, or
    whose values are not all finite (an engine never samples from NaN weights)."""
    have = dict(nnx.to_flat_state(current))
    got = dict(nnx.to_flat_state(new))

    def name(path: tuple) -> str:
        return ".".join(str(p) for p in path)

    for path in sorted(set(have) | set(got), key=name):
        if path not in got:
            raise ValueError(f"update_weights: missing parameter {name(path)!r}")
        if path not in have:
            raise ValueError(f"update_weights: unexpected parameter {name(path)!r}")
        if type(have[path]) is not type(got[path]) and not isinstance(got[path], jax.Array):
            raise ValueError(
                f"update_weights: {name(path)!r} is a {type(got[path]).__name__}, the engine's is "
                f"a {type(have[path]).__name__}"
            )
        want, value = _array(have[path]), _array(got[path])
        if want.shape != value.shape:
            raise ValueError(
                f"update_weights: {name(path)!r} has shape {tuple(value.shape)}, the engine's has "
                f"{tuple(want.shape)}"
            )
        if want.dtype != value.dtype:
            raise ValueError(
                f"update_weights: {name(path)!r} has dtype {value.dtype}, the engine's has "
                f"{want.dtype}"
            )
    floating = [p for p in got if jnp.issubdtype(_array(got[p]).dtype, jnp.inexact)]
    # one transfer for the whole tree
    finite = jax.device_get(_all_finite([_array(got[p]) for p in floating]))
    bad = sorted((p for p, ok in zip(floating, finite, strict=True) if not ok), key=name)
    if bad:
        raise ValueError(
            f"update_weights: {name(bad[0])!r} has non-finite values ({len(bad)} parameter(s) "
            "do); the engine keeps its weights"
        )


@jax.jit
def _all_finite(arrays: list[jax.Array]) -> list[jax.Array]:
    return [jnp.all(jnp.isfinite(array)) for array in arrays]


def _array(leaf: Any) -> jax.Array | np.ndarray:
    return leaf.get_value() if hasattr(leaf, "get_value") else leaf
