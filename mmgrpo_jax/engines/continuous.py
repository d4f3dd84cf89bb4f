"""The continuous-batching JAX engine: a fixed pool of sequence slots that requests join and
leave between short decode calls (docs/design.md#engine).

One dispatcher thread loops: queued requests take free slots (their prompts prefilled in one
pass, sharing any prefix another slot already holds), then every live slot decodes
`decode_steps` tokens in one jitted call, and each finished row goes back to its caller at once,
so its program moves on to its next module while the others keep decoding. Requests with
different sampling settings share a pass (every row carries its own temperature, top-k, top-p,
token budget and key). Keys come from the request (docs/design.md#determinism), so a sample does not
depend on which requests it was scheduled with, or when: the engine returns what sampling each
request alone would.

While the pool has rows, the next pass waits (at most `max_wait_s`) until every registered
caller is in the pool or queued: which requests share a pass then follows from the programs, not
from thread timing, so a run samples alike every time (and after a resume).

Prefix sharing: a slot keeps the tokens whose keys and values it holds until it is given to
another request or the weights change. A new request whose prompt starts with some of them (the
G rollouts' first calls, a fixed system prompt and demos) is prefilled from the end of the
shared part on top of a copy of that slot's cache, within its share group (one training step).
When the best source is another request admitted at the same time, the request waits for that
one's pass (one pass later, in the same admission).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from mmgrpo_jax.engines.base import Completion, Request
from mmgrpo_jax.engines.local import LocalEngine, Pending, schedule_order
from mmgrpo_jax.sampler.generate import check_arguments
from mmgrpo_jax.sampler.slot_pool import DecodeRows, RowSampling, SlotPool
from models.decoder import Decoder

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens per prefill pass: widths 16 ... 256 only
# rows of one prefill pass: it gathers (copies) its rows whole, so this bounds the copy to a
# share of the pool; powers of two up to it are the prefill's row shapes
MAX_PREFILL_ROWS = 16
MIN_WAIT_GAIN = 32  # tokens: a request waits a wave for a longer shared prefix than this


@dataclasses.dataclass
class _Row:
    """A request in its slot."""

    pending: Pending
    key: Any  # its PRNG key
    prompt: tuple[int, ...]
    tokens: list[int]
    logprobs: list[float]
    version: int  # of the weights its prompt was prefilled with

    @property
    def filled(self) -> int:
        """Slots holding its tokens: the prompt and every sampled token but the last."""
        return len(self.prompt) + len(self.tokens) - 1


@dataclasses.dataclass(frozen=True)
class _Held:
    """What a slot's cache holds, for prefix sharing."""

    group: Any  # its request's share group
    version: int  # the weights it was computed with
    tokens: np.ndarray


@dataclasses.dataclass(frozen=True)
class _Joining:
    """A request given a slot, prefilled from `shared` on top of `source`'s first slots."""

    slot: int
    source: int
    shared: int
    pending: Pending
    key: Any


class ContinuousEngine(LocalEngine):
    """`RolloutEngine` over a local Decoder with continuous batching; thread-safe."""

    def __init__(
        self,
        model: Decoder,
        *,
        stop_token_ids: Sequence[int],
        trainable: Any = None,
        slots: int = 64,
        decode_steps: int = 8,
        max_wait_s: float = 0.05,
        seed: int = 0,
        prefix_sharing: bool = True,
        max_cache_tokens: int | None = None,
        mesh: Mesh | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """`slots` rows decode together at most (on a mesh, rounded up to a multiple of its
        data x fsdp devices); `decode_steps` tokens per jitted decode call (between calls
        finished rows leave and queued requests join); `max_cache_tokens` bounds slots x cache
        length (the pool grows with the longest request); `prefill_chunk` > 0 prefills at most
        that many tokens of a prompt per pass (so prefill shapes, and compiles, stay few)."""
        super().__init__(
            model,
            stop_token_ids=stop_token_ids,
            trainable=trainable,
            max_batch=slots,
            max_wait_s=max_wait_s,
            seed=seed,
        )
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {decode_steps}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        self.decode_steps, self.prefix_sharing = decode_steps, prefix_sharing
        self.prefill_chunk = prefill_chunk
        self._pool = SlotPool(
            model,
            slots,
            eos_token_ids=stop_token_ids,
            max_cache_tokens=max_cache_tokens,
            mesh=mesh,
        )
        self.mesh = mesh
        self.max_batch = self._stats.max_batch = self._pool.rows
        self._eos = frozenset(self.stop_token_ids)
        self._live: dict[int, _Row] = {}  # slot -> its request
        self._free: deque[int] = deque(range(self._pool.rows))  # longest free first: keeps prefixes
        # slot -> what its cache holds; only caches of the current weights are shared
        self._held: dict[int, _Held] = {}
        self._version = 0  # the weights version of this tick's passes
        self._start()

    # -- the dispatcher ------------------------------------------------------------------------
    def _tick_ready(self, since: float) -> bool:
        """The next pass may start. With rows in the pool: every registered caller is in it or
        queued (so which requests share a pass does not depend on thread timing, and a run
        samples alike every time), or `max_wait_s` passed since the last pass. With an empty
        pool: a batch is ready, as for the static batcher. Call under the lock."""
        if not self._live:
            return self._batch_ready()
        accounted = len(self._live) + len(self._pending) >= self._clients
        return accounted or time.monotonic() - since >= self.max_wait_s

    def _dispatch_loop(self) -> None:
        since = time.monotonic()
        while True:
            with self._cond:
                while not self._closed and not self._tick_ready(since):
                    self._cond.wait(timeout=self.max_wait_s / 4)
                if self._closed:
                    self._fail(
                        [row.pending for row in self._live.values()],
                        RuntimeError("the ContinuousEngine was closed"),
                    )
                    return
                joining = sorted(self._pending, key=schedule_order)[: len(self._free)]
                taken = {id(p) for p in joining}
                self._pending = [p for p in self._pending if id(p) not in taken]
                admitted = []  # (request, its key)
                for p in joining:
                    try:
                        admitted.append((p, self._request_key(p.request)))
                    except (ValueError, OverflowError) as err:  # a bad key path: its caller's
                        p.future.set_exception(err)
                graphdef, *states = self._model_states()
                self._version = self._weights_version
            model = (graphdef, tuple(states))
            try:
                if admitted:
                    self._admit(model, admitted)
                if self._live:
                    self._decode(model)
            except Exception as err:  # every caller in the pool sees it; none hangs
                self._fail([row.pending for row in self._live.values()], err)
                self._fail(joining, err)
                self._live.clear()
                self._held.clear()
                self._free = deque(range(self._pool.rows))
                self._pool.reset()  # a failed pass may have consumed the donated cache
            since = time.monotonic()

    def _admit(self, model, admitted: list[tuple[Pending, Any]]) -> None:
        """Prefill the admitted requests into free slots, in waves: a request whose best prefix
        source joins with it waits for that one's wave."""
        waiting = list(admitted)
        for pending, _ in waiting:
            self._check(pending)
        waiting = [(p, k) for p, k in waiting if not p.future.done()]
        while waiting:
            plans, later = [], []
            wave_prompts: list[tuple[Any, np.ndarray]] = []  # (share group, prompt)
            for pending, key in waiting:
                prompt = np.asarray(pending.request.prompt_ids)
                group = _share_group(pending.request)
                source, shared = self._best_source(prompt, group)
                # waiting a wave pays when a request of this wave holds much more of the prompt
                common = (_common(prompt, other) for g, other in wave_prompts if g == group)
                gain = max(common, default=0) - shared
                if self.prefix_sharing and gain >= min(MIN_WAIT_GAIN, len(prompt) // 2) > 0:
                    later.append((pending, key))
                    continue
                plans.append((pending, key, source, shared))
                wave_prompts.append((group, prompt))
            # a slot another request of this wave copies from is not rewritten in this wave (a
            # chunked prefill would overwrite it before the copy)
            sources = {source for _, _, source, shared in plans if shared}
            wave = []
            for pending, key, source, shared in plans:
                slot = next((s for s in self._free if s not in sources), None)
                if slot is None:
                    later.append((pending, key))
                    continue
                self._free.remove(slot)
                self._held.pop(slot, None)  # being rewritten: no longer a source
                wave.append(_Joining(slot, source if shared else slot, shared, pending, key))
            if not wave:  # every free slot is a source: the first request prefills unshared
                (pending, key), later = later[0], later[1:]
                slot = self._free.popleft()
                self._held.pop(slot, None)
                wave.append(_Joining(slot, slot, 0, pending, key))
            for start in range(0, len(wave), MAX_PREFILL_ROWS):
                self._extend(model, wave[start : start + MAX_PREFILL_ROWS])
            waiting = later

    def _check(self, pending: Pending) -> None:
        """Fail a request the pool cannot take in its caller, naming the bad value."""
        request, settings = pending.request, pending.request.sampling
        try:
            check_arguments(
                [request.prompt_ids],
                self.model_config,
                settings.max_new_tokens,
                settings.temperature,
                settings.top_p,
                settings.top_k,
            )
            needed = len(request.prompt_ids) + settings.max_new_tokens + self.decode_steps
            self._pool.ensure_slots(needed)
        except ValueError as err:
            pending.future.set_exception(err)

    def _best_source(self, prompt: np.ndarray, group: Any) -> tuple[int, int]:
        """(slot, tokens shared): the held prefix of the same share group longest in common
        with the prompt, keeping at least its last token to prefill (it samples the first new
        token)."""
        if not self.prefix_sharing:
            return 0, 0
        best, shared = 0, 0
        for slot, held in self._held.items():
            if held.group != group or held.version != self._version:
                continue
            n = min(_common(prompt, held.tokens), len(prompt) - 1)
            if n > shared:
                best, shared = slot, n
        return best, shared

    def _extend(self, model, wave: list[_Joining]) -> None:
        started = time.perf_counter()
        now = time.monotonic()
        pendings = [j.pending for j in wave]
        sampling = _row_sampling(pendings, [j.key for j in wave])
        sources, starts = [j.source for j in wave], [j.shared for j in wave]
        ends = [len(j.pending.request.prompt_ids) for j in wave]
        chunk = self.prefill_chunk
        while chunk and (long := [i for i, j in enumerate(wave) if ends[i] - starts[i] > chunk]):
            # a chunk of every long prompt (its sample is not used): the next starts after it
            self._pool.extend(
                model,
                source_rows=[sources[i] for i in long],
                rows=[wave[i].slot for i in long],
                tokens=[
                    wave[i].pending.request.prompt_ids[starts[i] : starts[i] + chunk] for i in long
                ],
                starts=[starts[i] for i in long],
                sampling=sampling.select(np.asarray(long)),
            )
            for i in long:
                sources[i], starts[i] = wave[i].slot, starts[i] + chunk
            with self._cond:
                self._stats.dispatches += 1
        token, logprob = self._pool.extend(
            model,
            source_rows=sources,
            rows=[j.slot for j in wave],
            tokens=[
                j.pending.request.prompt_ids[start:] for j, start in zip(wave, starts, strict=True)
            ],
            starts=starts,
            sampling=sampling,
        )
        for j, first, first_logprob in zip(wave, token, logprob, strict=True):
            prompt = j.pending.request.prompt_ids
            group = _share_group(j.pending.request)
            self._held[j.slot] = _Held(group, self._version, np.asarray(prompt))
            row = _Row(
                j.pending, j.key, prompt, [int(first)], [float(first_logprob)], self._version
            )
            self._live[j.slot] = row
            self._finish_if_done(j.slot, row)
        with self._cond:
            stats = self._stats
            stats.dispatches += 1
            stats.queue_wait_s += sum(now - p.queued_at for p in pendings)
            stats.sample_s += time.perf_counter() - started
            stats.tokens += len(wave)
            stats.prompt_tokens += sum(ends)
            stats.shared_prefix_tokens += sum(j.shared for j in wave)
            stats.compiles = self._pool.traces

    def _decode(self, model) -> None:
        started = time.perf_counter()
        slots = list(self._live)
        rows = [self._live[s] for s in slots]
        result = self._pool.decode(
            model,
            DecodeRows(
                rows=slots,
                last_token=[r.tokens[-1] for r in rows],
                filled=[r.filled for r in rows],
                generated=[len(r.tokens) for r in rows],
                max_new=[r.pending.request.sampling.max_new_tokens for r in rows],
                sampling=_row_sampling([r.pending for r in rows], [r.key for r in rows]),
            ),
            self.decode_steps,
        )
        new_tokens = 0
        for slot, row, tokens, logprobs in zip(
            slots, rows, result.tokens, result.logprobs, strict=True
        ):
            kept = tokens >= 0
            row.tokens += tokens[kept].tolist()
            row.logprobs += logprobs[kept].tolist()
            new_tokens += int(kept.sum())
            self._finish_if_done(slot, row)
        steps = int((result.tokens >= 0).sum(axis=1).max())
        with self._cond:
            stats = self._stats
            stats.dispatches += 1
            stats.tokens += new_tokens
            stats.row_steps += new_tokens
            stats.slot_steps += steps * result.width
            stats.sample_s += time.perf_counter() - started
            stats.compiles = self._pool.traces

    def _finish_if_done(self, slot: int, row: _Row) -> None:
        stopped = row.tokens[-1] in self._eos
        if not stopped and len(row.tokens) < row.pending.request.sampling.max_new_tokens:
            return
        del self._live[slot]
        held = np.asarray(row.prompt + tuple(row.tokens[:-1]))
        self._held[slot] = _Held(_share_group(row.pending.request), row.version, held)
        self._free.append(slot)
        with self._cond:
            self._stats.requests += 1
        completion = Completion(row.tokens, row.logprobs, "stop" if stopped else "length")
        row.pending.future.set_result(completion)


def _share_group(request: Request) -> Any:
    """Requests share caches only within a group: the step of a keyed request (its key path's
    first entry), or all unkeyed ones, and one adapter (another adapter's keys and values of
    the same tokens differ). A shared prefix rounds its cache slightly differently from a whole
    prefill, so what a training step samples must not depend on what came before it (an
    evaluation, the steps before a resume): it depends on its own requests only."""
    return (None if request.key_path is None else request.key_path[0], request.adapter)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _row_sampling(pendings: Sequence[Pending], keys: Sequence) -> RowSampling:
    settings = [p.request.sampling for p in pendings]
    return RowSampling(
        keys=jnp.stack(keys),
        temperature=np.array([s.temperature for s in settings], np.float32),
        top_k=np.array([s.top_k for s in settings], np.int32),
        top_p=np.array([s.top_p for s in settings], np.float32),
        adapters=np.array([p.request.adapter for p in pendings], np.int32),
    )
