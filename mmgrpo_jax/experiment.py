"""`mmgrpo train` and `mmgrpo eval` on the paper's tasks: a config in, a run directory out.

The policy comes from a local Hugging Face checkpoint (`model_path`); the roles that are not
trained (PAPILLON's untrusted LM and judge) use an OpenAI-compatible server or, by default, the
same checkpoint's frozen base weights (shared, not copied) behind their own greedy batcher.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

import jax.numpy as jnp

from mmgrpo_jax.config import config_to_dict
from mmgrpo_jax.jax_lm import JaxLM, Sampling
from mmgrpo_jax.mmgrpo import MMGRPO, MMGRPOConfig, load_policy
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.rollout import score_examples, summarize
from models.decoder import Decoder
from models.export import adapter_lora_config, load_peft_adapter, without_lora
from models.hf import load_checkpoint
from models.tokenizer import HFTokenizer
from programs.tasks import Task, TaskConfig, build_task

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    mmgrpo: MMGRPOConfig = dataclasses.field(default_factory=MMGRPOConfig)
    train_limit: int | None = None  # first N training examples (smoke runs)
    val_limit: int | None = None

    def __post_init__(self) -> None:
        if self.mmgrpo.model_path is None:
            raise ValueError("TrainConfig.mmgrpo.model_path must name a local HF checkpoint")
        for name in ("train_limit", "val_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1 or null, got {value}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    model_path: str = ""
    adapter_path: str | None = None  # a PEFT adapter, e.g. <run_dir>/adapter
    split: Literal["train", "dev", "test"] = "dev"
    limit: int | None = None
    max_completion_tokens: int = 512
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    out: str | None = None  # predictions JSONL; default runs/eval-<task>-<split>-<time>.jsonl

    def __post_init__(self) -> None:
        if not self.model_path or not Path(self.model_path).is_dir():
            raise ValueError(
                f"EvalConfig.model_path={self.model_path!r} is not a directory (a local Hugging "
                "Face checkpoint)"
            )
        if self.adapter_path is not None and not Path(self.adapter_path).is_dir():
            raise ValueError(f"EvalConfig.adapter_path={self.adapter_path!r} is not a directory")
        if self.split not in ("train", "dev", "test"):
            raise ValueError(f"EvalConfig.split must be train, dev or test, got {self.split!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"EvalConfig.limit must be >= 1 or null, got {self.limit}")


class FrozenBaseLMs:
    """Greedy LMs on the base weights of a policy, made on demand and closed together."""

    def __init__(self, model: Decoder, tokenizer: HFTokenizer, stop: Sequence[int]) -> None:
        self.base = without_lora(model) if model.lora is not None else model
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.lms: list[JaxLM] = []

    def __call__(self, max_tokens: int) -> JaxLM:
        lm = JaxLM(
            self.base,
            self.tokenizer,
            sampling=Sampling(max_tokens, temperature=0.0),
            stop_token_ids=self.stop,
        )
        self.lms.append(lm)
        return lm

    def close(self) -> None:
        for lm in self.lms:
            lm.close()


def _first(examples: list[Example], limit: int | None) -> list[Example]:
    return examples if limit is None else examples[:limit]


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    model, tokenizer, stop = load_policy(cfg.mmgrpo)
    frozen = FrozenBaseLMs(model, tokenizer, stop)
    try:
        task = build_task(cfg.task, frozen)
        optimizer = MMGRPO(
            task.metric, cfg.mmgrpo, model=model, tokenizer=tokenizer, stop_token_ids=stop
        )
        program = optimizer.compile(
            task.program,
            _first(task.splits.train, cfg.train_limit),
            _first(task.splits.dev, cfg.val_limit),
        )
    finally:
        frozen.close()
    run_dir = Path(cfg.mmgrpo.run_dir)
    program.save(run_dir / "program.json")
    (run_dir / "train_config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
    return {**(optimizer.summary or {}), "run_dir": str(run_dir)}


def load_eval_policy(cfg: EvalConfig) -> tuple[Decoder, HFTokenizer, tuple[int, ...]]:
    lora = None if cfg.adapter_path is None else adapter_lora_config(cfg.adapter_path)
    model, tokenizer, stop = load_checkpoint(cfg.model_path, dtype=jnp.dtype(cfg.dtype), lora=lora)
    if cfg.adapter_path is not None:
        load_peft_adapter(model, cfg.adapter_path)
    return model, tokenizer, stop


def evaluate_task(
    task: Task, examples: list[Example], lm: JaxLM, out: Path, progress: bool = True
) -> dict[str, Any]:
    """Greedy run over `examples`; failures score 0; one JSONL line per example."""
    trajectories = score_examples(task.program, examples, task.metric, lm=lm, progress=progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for example, t in zip(examples, trajectories, strict=True):
            record = {
                "index": t.example_index,
                "inputs": example.inputs(),
                "labels": example.labels(),
                "prediction": None if t.prediction is None else dict(t.prediction),
                "score": t.reward,
                "status": t.status,
                "error": t.error,
            }
            f.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    counts = summarize(trajectories)
    return {
        "metric": counts["reward_mean"],
        "examples": len(trajectories),
        "format_failures": counts["status_format_failure"],
        "errors": counts["status_error"],
        "predictions": str(out),
    }


def run_eval(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    model, tokenizer, stop = load_eval_policy(cfg)
    frozen = FrozenBaseLMs(model, tokenizer, stop)
    policy = JaxLM(
        model,
        tokenizer,
        sampling=Sampling(cfg.max_completion_tokens, temperature=0.0),
        stop_token_ids=stop,
    )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.out or f"runs/eval-{cfg.task.name}-{cfg.split}-{stamp}.jsonl")
    try:
        task = build_task(cfg.task, frozen)
        examples = _first(task.splits.get(cfg.split), cfg.limit)
        result = evaluate_task(task, examples, policy, out, progress)
    finally:
        policy.close()
        frozen.close()
    return {"task": cfg.task.name, "split": cfg.split, **result}


def main(config: TrainConfig | EvalConfig, out: TextIO) -> int:
    result = run_train(config) if isinstance(config, TrainConfig) else run_eval(config)
    print(json.dumps(result, indent=2), file=out)
    return 0
