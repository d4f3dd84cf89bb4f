"""Any rollout engine as an LM of the program layer: chat template in, text and token ids out.

`EngineLM(engine, tokenizer, sampling=...)` renders a call's messages with the tokenizer's chat
template, submits one request (ordered by the calling rollout's trace key) and waits for it; the
output carries the exact sampled ids and log-probs into the trace. `EngineLM.local(model, ...)`
builds (and owns) a `JaxEngine` on a local policy. With per-module adapters, `adapter_of` names
the adapter of the predictor making the call (`LoRAConfig.adapter_id`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
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
        adapter_of: Callable[[str], int] | None = None,
        adapter: int | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        # per-module adapters: route each call by its predictor, or serve one adapter throughout
        adapters = getattr(engine, "num_adapters", 1)
        if adapter_of is not None and adapter is not None:
            raise ValueError(f"pass adapter_of or adapter={adapter} to EngineLM, not both")
        if adapters > 1 and adapter_of is None and adapter is None:
            raise ValueError(
                f"the engine's policy has {adapters} adapters (per-module LoRA): pass "
                "adapter_of=<predictor name -> adapter id> (e.g. LoRAConfig.adapter_id) or "
                "adapter=<id>, so no call lands on an adapter by default"
            )
        self.adapter_of, self.adapter = adapter_of, adapter or 0
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
        adapter_of: Callable[[str], int] | None = None,
        adapter: int | None = None,
    ) -> EngineLM:
        """An LM on its own JaxEngine over `model` (closed with the LM). A model with several
        adapters routes each call by its LoRA config's module patterns, unless `adapter_of`
        routes otherwise or `adapter` names the one adapter every call uses."""
        if adapter is None:
            adapter_of = adapter_of or module_adapters(model)
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
            adapter_of=adapter_of,
            adapter=adapter,
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
        request = Request(tuple(prompt), settings, order, key_path, self._adapter())
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

    def _adapter(self) -> int:
        """The adapter of the predictor calling (the fixed one without routing)."""
        if self.adapter_of is None:
            return self.adapter
        predictor = current().predictor
        if predictor is None:
            raise RuntimeError(
                "this LM routes calls to per-module adapters (adapter_of) and was called "
                "outside a traced predictor call, so no module names the adapter; call it from "
                "a program's predictor inside record_trace, or build it with adapter=<id>"
            )
        return self.adapter_of(predictor)

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


def module_adapters(model: Decoder) -> Callable[[str], int] | None:
    """A predictor name's adapter id on a model with per-module adapters (its LoRA config's
    module patterns); None with one adapter or none, where every call uses the same weights."""
    if model.lora is None or model.lora.num_adapters == 1:
        return None
    return model.lora.adapter_id
