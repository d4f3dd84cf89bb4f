"""The local JAX policy as an LM of the program layer, behind a request batcher.

Rollout threads call `lm(messages)` concurrently; each call renders its chat prompt, queues it and
blocks. One dispatcher thread owns the model: it waits until every registered client (a running
rollout) is waiting, or `max_batch` requests are queued, or the oldest request has waited
`max_wait_s`, then samples one batch per distinct sampling setting and hands each caller its
completion with token ids and log-probs. Clients register through `open_client` /
`close_client`, which `run_rollouts` calls for the LM it is given.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from jax.sharding import Mesh

from mmgrpo_jax.program.lm import LMOutput
from mmgrpo_jax.program.trace import current
from mmgrpo_jax.sampling import generate
from models.decoder import Decoder
from models.tokenizer import HFTokenizer, chat_prompt_ids

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings; requests are batched only with identical settings."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling
    future: Future
    queued_at: float
    order: tuple | None  # (example, rollout, call) inside a rollout: fixes its row in a batch


@dataclasses.dataclass
class BatcherStats:
    """How full the sampler calls were: the number behind 'keep the sampler busy'."""

    dispatches: int = 0
    requests: int = 0
    max_batch: int = 1

    @property
    def mean_batch(self) -> float:
        return self.requests / self.dispatches if self.dispatches else 0.0

    @property
    def occupancy(self) -> float:
        return self.mean_batch / self.max_batch


class JaxLM:
    """`lm(messages, **sampling) -> LMOutput` on a local Decoder; thread-safe, batched."""

    def __init__(
        self,
        model: Decoder,
        tokenizer: HFTokenizer,
        *,
        sampling: Sampling,
        stop_token_ids: Sequence[int],
        max_prompt_tokens: int | None = None,
        max_batch: int = 64,
        max_wait_s: float = 0.05,
        seed: int = 0,
        mesh: Mesh | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_prompt_tokens = max_prompt_tokens
        self.max_batch, self.max_wait_s, self.mesh = max_batch, max_wait_s, mesh
        self.stats = BatcherStats(max_batch=max_batch)
        self._seed = seed
        self._calls = 0
        self._pending: list[_Request] = []
        self._clients = 0
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._dispatch_loop, name="jax-lm", daemon=True)
        self._thread.start()

    # -- the LM protocol -------------------------------------------------------------------
    def __call__(self, messages: Sequence[dict[str, str]], **sampling: Any) -> LMOutput:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"unknown sampling arguments {unknown}; allowed: {SAMPLING_KEYS}")
        settings = dataclasses.replace(self.sampling, **sampling)
        prompt = chat_prompt_ids(self.tokenizer, messages)
        if self.max_prompt_tokens is not None and len(prompt) > self.max_prompt_tokens:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, more than max_prompt_tokens="
                f"{self.max_prompt_tokens}"
            )
        trace = current().trace
        order = None if trace is None or trace.key is None else (*trace.key, len(trace.calls))
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("this JaxLM is closed")
            self._pending.append(_Request(prompt, settings, future, time.monotonic(), order))
            self._cond.notify_all()
        completion = future.result()
        ids = completion.token_ids
        body = ids[:-1] if completion.finish_reason == "stop" else ids
        return LMOutput(
            text=self.tokenizer.decode(body, skip_special_tokens=True),
            prompt_ids=tuple(prompt),
            completion_ids=tuple(ids),
            logprobs=tuple(completion.logprobs),
            finish_reason=completion.finish_reason,
        )

    @property
    def calls(self) -> int:
        """Sampler calls so far; with the seed it fixes the next call's PRNG stream (resume)."""
        return self._calls

    @calls.setter
    def calls(self, value: int) -> None:
        with self._cond:
            self._calls = int(value)

    # -- clients: who may still send a request -----------------------------------------------
    def open_client(self) -> None:
        with self._cond:
            self._clients += 1

    def close_client(self) -> None:
        with self._cond:
            self._clients -= 1
            self._cond.notify_all()  # the others may now all be waiting

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
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
                settings = self._pending[0].sampling
                # Rows are sampled by position: order them by rollout, not by thread timing, so
                # a run is reproducible (and resumable) whenever batches are full.
                same = sorted(
                    (r for r in self._pending if r.sampling == settings),
                    key=lambda r: (r.order is None, r.order or (), r.queued_at),
                )
                batch = same[: self.max_batch]
                taken = {id(r) for r in batch}
                self._pending = [r for r in self._pending if id(r) not in taken]
                seed = self._seed * 1_000_003 + self._calls  # a fresh stream every call
                self._calls += 1
            self._run(batch, settings, seed)

    def _run(self, batch: list[_Request], settings: Sampling, seed: int) -> None:
        try:
            completions = generate(
                self.model,
                [r.prompt_ids for r in batch],
                max_new_tokens=settings.max_new_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                eos_token_ids=self.stop_token_ids,
                seed=seed,
                mesh=self.mesh,
            )
        except Exception as err:  # every waiting caller sees the failure; none hangs
            for request in batch:
                request.future.set_exception(err)
            return
        with self._cond:
            self.stats.dispatches += 1
            self.stats.requests += len(batch)
        for request, completion in zip(batch, completions, strict=True):
            request.future.set_result(completion)
