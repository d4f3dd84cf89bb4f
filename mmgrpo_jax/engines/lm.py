"""Any rollout engine as an LM of the program layer: chat template in, text and token ids out.

`EngineLM(engine, tokenizer, sampling=...)` renders a call's messages with the tokenizer's chat
template, submits one request (ordered by the calling rollout's trace key) and waits for it; the
output carries the exact sampled ids and log-probs into the trace. `EngineLM.local(model, ...)`
builds (and owns) a `JaxEngine` on a local policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from mmgrpo_jax.engines.base import EngineStats, Request, RolloutEngine, Sampling
from mmgrpo_jax.engines.jax_engine import JaxEngine
from mmgrpo_jax.program.lm import LMOutput
from mmgrpo_jax.program.trace import current
from models.decoder import Decoder
from models.tokenizer import HFTokenizer, chat_prompt_ids

SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(Sampling))


class EngineLM:
    """`lm(messages, **sampling) -> LMOutput` on a rollout engine; thread-safe."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: HFTokenizer,
        *,
        sampling: Sampling,
        max_prompt_tokens: int | None = None,
        owns_engine: bool = False,
    ) -> None:
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        if max_prompt_tokens is not None and max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1 or None, got {max_prompt_tokens}")
        self.max_prompt_tokens = max_prompt_tokens
        self._owns_engine = owns_engine

    @classmethod
    def local(
        cls,
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
    ) -> EngineLM:
        """An LM on its own JaxEngine over `model` (closed with the LM)."""
        engine = JaxEngine(
            model,
            stop_token_ids=stop_token_ids,
            max_batch=max_batch,
            max_wait_s=max_wait_s,
            seed=seed,
            mesh=mesh,
        )
        return cls(
            engine,
            tokenizer,
            sampling=sampling,
            max_prompt_tokens=max_prompt_tokens,
            owns_engine=True,
        )

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
        call = 0 if trace is None else trace.next_call()
        order = None if trace is None or trace.key is None else (*trace.key, call)
        key_path = None if trace is None or trace.key_path is None else (*trace.key_path, call)
        request = Request(tuple(prompt), settings, order, key_path)
        completion = self.engine.submit(request).result()
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
    def stats(self) -> EngineStats:
        return self.engine.stats

    # -- clients: run_rollouts registers the rollouts that may still send a request ----------
    def open_client(self) -> None:
        self.engine.open_client()

    def close_client(self) -> None:
        self.engine.close_client()

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()
