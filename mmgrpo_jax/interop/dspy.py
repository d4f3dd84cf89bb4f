"""Bring your DSPy program: an unmodified `dspy.Module` trained with mmGRPO on the JAX policy.

* `PolicyLM`: a `dspy.LM` whose engine (`PolicyEngine`) is any LM of this project, an
  `EngineLM` on a rollout engine or a scripted one. DSPy's messages go through the policy's chat
  template; DSPy gets back text, usage and, when it asks, log-probs. Any DSPy program and DSPy's
  own optimizers (`BootstrapFewShot`, `MIPROv2`) run on it with no server.
* `DSPyProgram`: a `dspy.Module` as a program of this project. In a rollout, every call of every
  predictor (named as DSPy's `named_predictors()` names it) goes into the rollout's trace with
  its messages, prompt and completion ids, sampler log-probs and invocation index; a reply DSPy's
  adapter cannot parse is a format failure, an exception an error (docs/design.md#grouping).
* `dspy_metric`, `from_dspy_examples`: DSPy's metrics and examples as the trainer takes them.

`MMGRPO.compile` takes a `dspy.Module`, `dspy.Example`s and a DSPy metric directly (`train`).

Concurrent rollouts do not mix their traces: DSPy's settings are context variables, each rollout
thread enters its own `dspy.context` carrying that rollout's trace, and the predictor calls open
in a thread are a context variable of this module. `dspy.Parallel` copies the DSPy context into
its workers, so a program that fans out records into its own rollout (in the order the calls
start, as for native programs calling from threads).
"""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import functools
import inspect
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp

from mmgrpo_jax import parallel
from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program import adapter as chat_adapter
from mmgrpo_jax.program.adapter import ParseError
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.lm import LM, LMOutput
from mmgrpo_jax.program.module import Module, check_call
from mmgrpo_jax.program.signature import Field, Signature
from mmgrpo_jax.program.trace import CallRecord, RunContext, calling, current
from mmgrpo_jax.rl.types import Metric
from models.export import adapter_lora_config, load_peft_adapter
from models.hf import load_checkpoint

DSPY_REQUIREMENT = "dspy>=3.4,<3.5"

try:
    import dspy
    from dspy.lm15 import Message, Response, TextPart, TokenLogprob, Usage
    from dspy.utils.callback import BaseCallback
    from dspy.utils.exceptions import AdapterParseError
except ImportError as err:
    raise ImportError(
        f"mmgrpo_jax.interop.dspy needs DSPy ({DSPY_REQUIREMENT}): pip install -e '.[dspy]'"
    ) from err

logger = logging.getLogger(__name__)

RUN_SETTING = "mmgrpo_run"  # the DSPy setting that carries a rollout's RunContext


# -- the LM -----------------------------------------------------------------------------------
class PolicyEngine:
    """DSPy's engine contract (`complete(Request) -> Response`) over an LM of this project.

    In a rollout of a `DSPyProgram` the run's LM answers, with the run's sampler settings (the
    loss needs the temperature the tokens were sampled at); elsewhere `lm` answers, with DSPy's
    max_tokens, temperature, top_p and top_k. `source` (a model path and an adapter folder)
    lets a saved program rebuild the policy when it is loaded (`load_state`).
    """

    def __init__(self, lm: LM | None = None, source: Mapping[str, Any] | None = None) -> None:
        self._lm = lm
        self.source = None if source is None else dict(source)
        self._lock = threading.Lock()

    def policy(self) -> LM:
        with self._lock:
            if self._lm is None and self.source is not None:
                self._lm = _load_policy(self.source)
            if self._lm is None:
                raise RuntimeError(
                    "this PolicyLM has no policy: build it with PolicyLM(lm) or "
                    "PolicyLM.from_pretrained(path), or run it inside MMGRPO.compile"
                )
            return self._lm

    def complete(self, request: Any) -> Response:
        messages = _chat_messages(request)
        run = _run()
        if run is not None and run.lm is not None:
            lm, sampling = run.lm, {}
        else:
            lm, sampling = self.policy(), _sampling(request.config)
        call = _open_call()
        if call is None or run is None or run.trace is None:
            output = lm(messages, **sampling)
        else:
            output = call.answer(messages, lm, sampling, run)
        if not isinstance(output, LMOutput):
            raise TypeError(f"the policy LM must return LMOutput, got {type(output).__name__}")
        return _response(output, request, lm)

    def stream(self, request: Any) -> Any:
        raise NotImplementedError("PolicyEngine does not stream; call the LM without stream=")

    def close(self) -> None:
        closing = getattr(self._lm, "close", None)
        if callable(closing):
            closing()

    def dump_state(self) -> dict[str, Any]:
        return {"source": self.source}

    @classmethod
    def load_state(cls, state: Mapping[str, Any]) -> PolicyEngine:
        return cls(source=state.get("source"))


class PolicyLM(dspy.LM):
    """A `dspy.LM` on this project's policy: `PolicyLM(lm)` for any LM of this project
    (`EngineLM`, a scripted LM), `PolicyLM.local(model, tokenizer, stop_token_ids)` for a
    Decoder, `PolicyLM.from_pretrained(path, adapter=...)` for a checkpoint. Responses are never
    cached (every rollout must be a fresh sample) and never retried."""

    def __init__(
        self,
        lm: LM | None = None,
        *,
        model: str = "mmgrpo/policy",
        engine: PolicyEngine | None = None,
        **kwargs: Any,
    ) -> None:
        if engine is None:
            engine = PolicyEngine(lm)
        elif lm is not None:
            raise ValueError("pass lm or engine to PolicyLM, not both")
        if kwargs.setdefault("cache", False):
            raise ValueError("PolicyLM(cache=True): a cached reply would make every rollout alike")
        kwargs.setdefault("num_retries", 0)
        super().__init__(model, engine=engine, **kwargs)

    @classmethod
    def local(
        cls,
        model: Any,
        tokenizer: Any,
        stop_token_ids: Sequence[int],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        source: Mapping[str, Any] | None = None,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> PolicyLM:
        """A PolicyLM on its own JaxEngine over a local Decoder (greedy by default). On a model
        with per-module adapters, `adapter_name` is the one adapter it serves (the LM of one
        predictor: DSPy does not tell an LM which predictor calls it)."""
        lm = EngineLM.local(
            model,
            tokenizer,
            sampling=Sampling(max_new_tokens=max_tokens, temperature=temperature),
            stop_token_ids=stop_token_ids,
            adapter=_adapter_index(model, adapter_name),
        )
        engine = PolicyEngine(lm, source=source)
        return cls(engine=engine, max_tokens=max_tokens, temperature=temperature, **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        adapter: str | Path | None = None,
        dtype: str = "float32",
        max_tokens: int = 256,
        adapter_name: str | None = None,
        **kwargs: Any,
    ) -> PolicyLM:
        """A PolicyLM on a checkpoint (folder or GGUF) and optionally a PEFT adapter folder
        (with per-module adapters: `adapter_name`, the one it serves); the policy loads on the
        first call."""
        source = {"model_path": str(path), "adapter": None if adapter is None else str(adapter)}
        source.update(dtype=dtype, max_tokens=max_tokens, adapter_name=adapter_name)
        kwargs.setdefault("temperature", 0.0)
        return cls(engine=PolicyEngine(source=source), max_tokens=max_tokens, **kwargs)

    @property
    def policy_engine(self) -> PolicyEngine:
        return self._engine_spec

    def close(self) -> None:
        self.policy_engine.close()

    def __deepcopy__(self, memo: dict[int, Any]) -> PolicyLM:
        # DSPy deep-copies programs (optimizers, deepcopy()); a policy holds weights and an
        # engine's threads, which copies share, as dspy.LM.copy shares provider clients
        return self.copy()


def _load_policy(source: Mapping[str, Any]) -> LM:
    adapter = source.get("adapter")
    lora = None if adapter is None else adapter_lora_config(adapter)
    dtype = jnp.dtype(source.get("dtype", "float32"))
    model, tokenizer, stop = load_checkpoint(source["model_path"], dtype=dtype, lora=lora)
    if adapter is not None:
        load_peft_adapter(model, adapter, base_model=str(source["model_path"]))
    sampling = Sampling(max_new_tokens=int(source.get("max_tokens", 256)), temperature=0.0)
    adapter = _adapter_index(model, source.get("adapter_name"))
    return EngineLM.local(model, tokenizer, sampling=sampling, stop_token_ids=stop, adapter=adapter)


def _adapter_index(model: Any, name: str | None) -> int | None:
    """The id of adapter `name`, which every call then uses (None: the model's own routing,
    which needs a traced predictor call when it has several adapters)."""
    if name is None:
        return None
    names = () if model.lora is None else model.lora.adapter_names
    if name not in names:
        raise ValueError(f"adapter_name={name!r} is not one of the policy's adapters {list(names)}")
    return names.index(name)


def _chat_messages(request: Any) -> list[dict[str, str]]:
    """DSPy's canonical request as chat messages; anything but text is refused by name."""
    messages = []
    if request.system is not None:
        system = request.system
        if not isinstance(system, str):
            system = "".join(_text(part, "system") for part in system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        content = "".join(_text(part, f"message {i}") for part in message.parts)
        messages.append({"role": message.role, "content": content})
    return messages


def _text(part: Any, where: str) -> str:
    if not isinstance(part, TextPart):
        raise ValueError(
            f"{where} holds a {type(part).__name__}: the policy reads text only (no images, "
            "files or tool calls)"
        )
    return part.text


def _sampling(config: Any) -> dict[str, Any]:
    settings = {
        "max_new_tokens": config.max_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "top_k": config.top_k,
    }
    return {key: value for key, value in settings.items() if value is not None}


def _response(output: LMOutput, request: Any, lm: LM) -> Response:
    prompt, completion = output.prompt_ids, output.completion_ids
    usage = Usage(
        input_tokens=None if prompt is None else len(prompt),
        output_tokens=None if completion is None else len(completion),
        total_tokens=None if prompt is None or completion is None else len(prompt + completion),
    )
    logprobs = None
    if request.config.logprobs is not None and output.logprobs is not None:
        tokenizer = getattr(lm, "tokenizer", None)
        logprobs = tuple(
            TokenLogprob(
                token="" if tokenizer is None else tokenizer.decode([token]),
                logprob=float(logprob),
                token_id=int(token),
            )
            for token, logprob in zip(completion, output.logprobs, strict=True)
        )
    return Response(
        id=None,
        model=request.model,
        message=Message.assistant([TextPart(output.text)]),
        finish_reason=output.finish_reason,
        usage=usage,
        logprobs=logprobs,
    )


class _QuietTruncationInRollouts(logging.Filter):
    """In a rollout, a reply cut at max_tokens is the sampler's budget at work (the trainer counts
    it); DSPy's warning for each would bury the log. Elsewhere DSPy warns as usual."""

    def filter(self, record: logging.LogRecord) -> bool:
        run = _run()
        in_rollout = run is not None and run.lm is not None
        return not (in_rollout and record.getMessage().startswith("LM response was truncated"))


logging.getLogger("dspy.clients.lm").addFilter(_QuietTruncationInRollouts())


# -- traces -------------------------------------------------------------------------------------
@dataclasses.dataclass
class _OpenCall:
    """A predictor call in progress: what the trace records once DSPy has parsed the reply."""

    call_id: str
    name: str
    invocation: int
    inputs: dict[str, Any]
    error: str | None = None  # why this call cannot be traced (raised at its LM call)
    messages: list[dict[str, str]] | None = None
    output: LMOutput | None = None
    replayed: bool = False

    def answer(
        self, messages: list[dict[str, str]], lm: LM, sampling: dict[str, Any], run: RunContext
    ) -> LMOutput:
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.output is not None:
            raise RuntimeError(
                f"predictor {self.name!r} made a second LM call in one call (n > 1, or an "
                "adapter's fallback such as ChatAdapter's JSON retry): mmGRPO trains one sampled "
                "reply per predictor call"
            )
        recorded = run.trace.replay.get((self.name, self.invocation))
        if recorded is None:
            with calling(self.name):
                output = lm(messages, **sampling)
        elif tuple(messages) != recorded.messages:
            raise RuntimeError(
                f"branch replay diverged at {self.name}[{self.invocation}]: the program asked "
                "something else than in the rollout it replays"
            )
        else:
            output = recorded.output
        self.messages, self.output, self.replayed = messages, output, recorded is not None
        return output


_OPEN_CALLS: contextvars.ContextVar[tuple[_OpenCall, ...]] = contextvars.ContextVar(
    "mmgrpo_dspy_open_calls", default=()
)


def _run() -> RunContext | None:
    return dspy.settings.get(RUN_SETTING)


def _open_call() -> _OpenCall | None:
    calls = _OPEN_CALLS.get()
    return calls[-1] if calls else None


class _Tracer(BaseCallback):
    """Opens a record when a traced program's predictor starts and writes it to the rollout's
    trace when the predictor ends, parsed or not. DSPy logs and swallows exceptions raised in
    callbacks, so a problem found here is raised at the predictor's LM call instead."""

    def on_module_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        run = _run()
        if run is None or run.trace is None or not isinstance(instance, dspy.Predict):
            return
        error = None
        try:
            name = run.trace.name_of(instance)
            invocation = run.trace.next_invocation(name)
        except RuntimeError as err:
            name, invocation, error = repr(instance), -1, str(err)
        given = dict(inputs.get("kwargs") or {})
        fields = {k: given[k] for k in instance.signature.input_fields if k in given}
        _OPEN_CALLS.set((*_OPEN_CALLS.get(), _OpenCall(call_id, name, invocation, fields, error)))

    def on_module_end(
        self, call_id: str, outputs: Any | None, exception: Exception | None = None
    ) -> None:
        calls = _OPEN_CALLS.get()
        if not calls or calls[-1].call_id != call_id:
            return  # not a traced predictor's call
        call = calls[-1]
        _OPEN_CALLS.set(calls[:-1])
        run = _run()
        if call.output is None or run is None or run.trace is None:
            return  # the predictor failed before its LM replied: nothing was sampled
        parse_error = str(exception) if isinstance(exception, AdapterParseError) else None
        fields = None
        if exception is None and outputs is not None:
            fields = {k: v for k, v in outputs.items() if k != "logprobs"}
        run.trace.record(
            CallRecord.from_output(
                call.name,
                call.invocation,
                call.messages,
                call.output,
                fields,
                parse_error,
                call.inputs,
                replayed=call.replayed,
            )
        )


# -- the program --------------------------------------------------------------------------------
class DSPyProgram(Module):
    """A `dspy.Module` as a program of this project (the module doc says what is recorded).

    In a rollout, every predictor runs on the run's policy with the DSPy adapter given here, or
    else the one DSPy's settings hold where this wrapper is built (rollouts run on other threads,
    which do not see that thread's `dspy.context`), or else `ChatAdapter`; ChatAdapter's JSON
    fallback is off: a reply that does not parse is a format failure, not a second, differently
    prompted sample.
    """

    def __init__(self, program: Any, *, adapter: Any | None = None) -> None:
        if not isinstance(program, dspy.Module):
            raise TypeError(f"DSPyProgram wraps a dspy.Module, got {type(program).__name__}")
        if not callable(getattr(type(program), "forward", None)):
            kind = "only aforward" if hasattr(type(program), "aforward") else "no forward"
            raise UserError(
                f"the DSPy program {type(program).__name__} defines {kind}: async programs are "
                "not supported (rollouts run each program on a thread of its own); define forward"
            )
        self.program = program
        self.adapter = adapter if adapter is not None else dspy.settings.adapter
        self.callbacks = list(dspy.settings.get("callbacks") or [])  # the same goes for these
        self._policy = PolicyLM()  # no LM of its own: in a rollout it samples from the run's
        self._tracer = _Tracer()

    def forward(self, **inputs: Any) -> Any:
        run = current()
        settings = {
            "adapter": _single_reply(self.adapter or dspy.ChatAdapter()),
            "callbacks": [*self.callbacks, self._tracer],
            RUN_SETTING: run,
        }
        if run.lm is not None:
            settings["lm"] = self._policy
        with dspy.context(**settings):
            try:
                return self.program(**inputs)
            except AdapterParseError as err:
                raise ParseError(
                    f"{err.adapter_name} could not parse a reply for "
                    f"`{getattr(err.signature, 'signature', err.signature)}`",
                    err.lm_response or "",
                ) from err

    def named_predictors(self) -> list[tuple[str, Any]]:
        return list(self.program.named_predictors())

    def check_inputs(self, inputs: Mapping[str, Any], where: str) -> None:
        # read through the class: DSPy warns when forward is fetched from an instance
        forward = functools.partial(type(self.program).forward, self.program)
        check_call(forward, type(self.program).__name__, inputs, where)

    def check_adapter(self) -> None:
        """Refuse, before any rollout, predictors the adapter cannot serve: BareAdapter writes
        one output field per reply, so a ChainOfThought (reasoning + answer) on it would fail
        every call."""
        if not isinstance(self.adapter, BareAdapter):
            return
        several = {
            name: list(p.signature.output_fields)
            for name, p in self.named_predictors()
            if len(p.signature.output_fields) != 1
        }
        if several:
            raise UserError(
                f"BareAdapter writes a reply of one output field; predictors {several} have "
                "several (ChainOfThought adds `reasoning`): give each one output field "
                "(dspy.Predict), or use ChatAdapter with a policy that writes its headed format"
            )

    def check_policy(self) -> None:
        """Refuse predictors that carry an LM other than a PolicyLM: their calls would bypass
        the policy being trained."""
        foreign = {
            name: getattr(p.lm, "model", type(p.lm).__name__)
            for name, p in self.named_predictors()
            if p.lm is not None and not isinstance(p.lm, PolicyLM)
        }
        if foreign:
            raise UserError(
                f"predictors {foreign} have their own LM: mmGRPO trains the policy behind every "
                "predictor; unset them (predictor.lm = None) or set a PolicyLM"
            )

    def copy(self) -> DSPyProgram:
        twin = DSPyProgram(self.program.deepcopy(), adapter=self.adapter)
        twin.callbacks = list(self.callbacks)
        return twin

    def set_lm(self, lm: LM | None) -> None:
        self.program.set_lm(None if lm is None else PolicyLM(lm))

    def dump_state(self) -> dict[str, Any]:
        return self.program.dump_state(json_mode=True)

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.program.load_state(dict(state))

    def save(self, path: str | Path) -> None:
        self.program.save(str(path))

    def load(self, path: str | Path) -> None:
        self.program.load(str(path))


def _single_reply(adapter: Any) -> Any:
    """The adapter without ChatAdapter's JSON retry (which would sample a second reply)."""
    if isinstance(adapter, dspy.ChatAdapter) and getattr(adapter, "use_json_adapter_fallback", 0):
        adapter = copy.copy(adapter)
        adapter.use_json_adapter_fallback = False
    return adapter


class KeepAdapter(BaseCallback):
    """The reply format a program was trained with, kept for calls made outside any
    `dspy.context` that sets an adapter (DSPy would otherwise use ChatAdapter, with its JSON
    fallback): an instance-level callback that opens `dspy.context(adapter=...)` when a module
    starts and closes it when the module ends. A context that sets an adapter wins."""

    def __init__(self, adapter: Any) -> None:
        super().__init__()
        self.adapter = adapter
        self._open: dict[str, Any] = {}  # call id -> the context this call entered

    def on_module_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        if dspy.settings.adapter is None:
            context = dspy.context(adapter=self.adapter)
            context.__enter__()
            self._open[call_id] = context

    def on_module_end(self, call_id: str, outputs: Any, exception: Exception | None = None) -> None:
        context = self._open.pop(call_id, None)
        if context is not None:
            context.__exit__(None, None, None)


def keep_adapter(program: Any, adapter: Any) -> None:
    """`program` and each of its predictors (callable alone too) keep `adapter` (KeepAdapter);
    a callback of an earlier training is replaced."""
    keeper = KeepAdapter(adapter)
    for module in [program, *(p for _, p in program.named_predictors())]:
        kept = [
            c for c in getattr(module, "callbacks", None) or [] if not isinstance(c, KeepAdapter)
        ]
        module.callbacks = [*kept, keeper]


# -- a format a small policy can write ----------------------------------------------------------
class BareAdapter(dspy.Adapter):
    """This project's bare format as a DSPy adapter: one output field whose value is the whole
    reply. The prompt is exactly what a native `Predict(..., bare=True)` renders, so a DSPy
    program on it samples what the same native program samples; a 135M policy can write it
    where DSPy's headed `ChatAdapter` format is beyond it."""

    def format(
        self, signature: Any, demos: list[Any], inputs: dict[str, Any]
    ) -> list[dict[str, str]]:
        shots = [d.toDict() if hasattr(d, "toDict") else dict(d) for d in demos]
        return chat_adapter.render(native_signature(signature), inputs, shots, bare=True)

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        try:
            return chat_adapter.parse(native_signature(signature), completion, bare=True)
        except ParseError as err:
            raise AdapterParseError(
                adapter_name=type(self).__name__,
                signature=signature,
                lm_response=completion,
                message=str(err),
            ) from err


def native_signature(signature: Any) -> Signature:
    """A DSPy signature as this project's (same fields, types, descriptions, instructions)."""

    def fields(found: Mapping[str, Any]) -> tuple[Field, ...]:
        return tuple(Field(name, f.annotation, _description(f, name)) for name, f in found.items())

    return Signature(
        fields(signature.input_fields), fields(signature.output_fields), signature.instructions
    )


def _description(field: Any, name: str) -> str:
    desc = (field.json_schema_extra or {}).get("desc", "")
    return "" if desc == f"${{{name}}}" else desc  # DSPy's placeholder for "no description"


# -- data and metrics ---------------------------------------------------------------------------
def from_dspy_examples(examples: Sequence[Any], name: str = "examples") -> list[Example]:
    """DSPy examples as this project's, keeping their `.with_inputs(...)` keys."""
    converted = []
    for i, example in enumerate(examples):
        if not isinstance(example, dspy.Example):
            raise TypeError(f"{name}[{i}] is a {type(example).__name__}, not a dspy.Example")
        try:
            keys = tuple(example.inputs().keys())
        except ValueError:
            raise UserError(
                f"{name}[{i}] has no input keys: mark them with example.with_inputs('field', ...)"
            ) from None
        converted.append(Example(keys, **example.toDict()))
    return converted


def to_dspy_example(example: Example) -> Any:
    return dspy.Example(**dict(example)).with_inputs(*example.input_keys)


def dspy_metric(metric: Callable[..., Any]) -> Metric:
    """A DSPy metric, `metric(example, pred, trace=None)` returning a float, a bool or a
    `dspy.Prediction` with a `score`, as the trainer calls metrics."""
    takes_trace = _takes_three(metric)

    def score(example: Example, prediction: Any) -> float | bool:
        dspy_example = to_dspy_example(example)
        if takes_trace:
            value = metric(dspy_example, prediction, None)
        else:
            value = metric(dspy_example, prediction)
        if isinstance(value, dspy.Prediction):
            if "score" not in value:
                raise TypeError(f"metric returned a dspy.Prediction without a score: {value!r}")
            value = value.score
        return value

    score.__name__ = getattr(metric, "__name__", "dspy_metric")
    return score


def _takes_three(fn: Callable[..., Any]) -> bool:
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): call it as DSPy does
        return True
    return True


# -- training -----------------------------------------------------------------------------------
def train(trainer: Any, program: Any, trainset: Sequence[Any], valset: Sequence[Any]) -> Any:
    """`MMGRPO.compile` on a DSPy program: train through `DSPyProgram`, then give back a deep
    copy of the program whose predictors' LM is the trained policy (greedy; with per-module
    adapters each predictor's LM serves its own adapter) and whose calls keep the reply format
    the rollouts used (`keep_adapter`), saved the DSPy way as `<run_dir>/program.json` beside
    the PEFT adapter."""
    wrapped = DSPyProgram(program)
    wrapped.check_policy()
    wrapped.check_adapter()
    metric = trainer.metric
    trainer.metric = dspy_metric(metric)
    try:
        trainer.compile(
            wrapped, from_dspy_examples(trainset, "trainset"), from_dspy_examples(valset, "valset")
        )
    finally:
        trainer.metric = metric
    cfg = trainer.config
    run_dir = Path(cfg.run_dir)
    source = None
    if cfg.model_path is not None and cfg.train == "lora":
        source = {"model_path": str(cfg.model_path), "adapter": str(run_dir / "adapter")}
        source.update(dtype=str(cfg.dtype), max_tokens=cfg.sampler.max_completion_tokens)
    trained = program.deepcopy()
    keep_adapter(trained, _single_reply(wrapped.adapter or dspy.ChatAdapter()))

    def policy(adapter_name: str | None = None) -> PolicyLM:
        return PolicyLM.local(
            trainer.model,
            trainer.tokenizer,
            trainer.stop_token_ids,
            max_tokens=cfg.sampler.max_completion_tokens,
            source=None if source is None else {**source, "adapter_name": adapter_name},
            adapter_name=adapter_name,
        )

    if cfg.per_module_adapters:  # each predictor's LM serves its module's adapter
        for name, predictor in trained.named_predictors():
            predictor.lm = policy(cfg.lora.adapter_names[cfg.lora.adapter_id(name)])
    else:
        trained.set_lm(policy())
    if parallel.is_main_process():
        trained.save(str(run_dir / "program.json"))
    return trained
