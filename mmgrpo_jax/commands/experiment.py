"""`mmgrpo train | optimize-prompts | better-together | eval` on the paper's tasks.

One `ExperimentConfig` file per (task, model) serves the first three: `train` runs mmGRPO,
`optimize-prompts` runs MIPROv2 with the policy running the program, `better-together` runs both
in the strategy's order. The policy comes from a local Hugging Face checkpoint
(`mmgrpo.model_path`); the roles that are not trained (PAPILLON's untrusted LM and judge, the
prompt model) use an OpenAI-compatible server or, by default, the same checkpoint's frozen base
weights (shared, not copied) behind their own engine. The policy's engine is one, shared by the
training rollouts and every greedy evaluation, and always holds the latest weights.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

import jax.numpy as jnp

from mmgrpo_jax import parallel
from mmgrpo_jax.config_files import build_config, config_to_dict, config_tree, setting
from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.lm import EngineLM, module_adapters
from mmgrpo_jax.errors import UserError, check_field_types
from mmgrpo_jax.program.example import Example
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.prompt_opt.better_together import (
    BetterTogether,
    LoadedPrompts,
    Optimizer,
    StartScores,
    can_load_prompt_stage,
    parse_strategy,
)
from mmgrpo_jax.prompt_opt.mipro import MIPROv2, PromptOptConfig
from mmgrpo_jax.rl.rollout import score_examples, summarize
from mmgrpo_jax.rl.types import Trajectory
from mmgrpo_jax.trainer.config import MMGRPOConfig
from mmgrpo_jax.trainer.mmgrpo import MMGRPO, evaluate
from mmgrpo_jax.trainer.plan import check_fits
from mmgrpo_jax.trainer.policy import default_engine, load_policy
from mmgrpo_jax.trainer.run import check_run_dir
from mmgrpo_jax.trainer.run_log import write_atomic
from models.decoder import Decoder
from models.export import adapter_lora_config, load_peft_adapter, save_peft_adapter, without_lora
from models.fetch import MODELS, resolve_model_path
from models.hf import load_checkpoint
from models.tokenizer import HFTokenizer
from programs.tasks import (
    TASKS,
    ExternalLMConfig,
    Task,
    TaskConfig,
    build_task,
    external_or_local_lm,
    load_splits,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    mmgrpo: MMGRPOConfig = dataclasses.field(default_factory=MMGRPOConfig)
    prompt_opt: PromptOptConfig = dataclasses.field(default_factory=PromptOptConfig)
    prompt_lm: ExternalLMConfig = setting(
        note=(
            "Writes instruction proposals; no base_url: the checkpoint's frozen base "
            "weights. MIPROv2 proposes at temperature 1.0."
        ),
        factory=lambda: ExternalLMConfig(temperature=1.0),
    )
    prompt_state: str | None = setting(
        None, "prompts to start from: optimize-prompts' prompt_state.json"
    )
    strategy: str = setting(
        "p -> w", 'better-together\'s stages; "none": the program as written, scored'
    )
    prompt_stage: str | None = setting(
        None,
        (
            "better-together's first stage, p, read from a finished MIPROv2 run of the same "
            "config and seed (its prompts/prompt_state.json) instead of searched again: "
            "loaded, then scored like any stage"
        ),
    )
    start_scores: str | None = setting(
        None,
        (
            "better-together's start stage: its valset and test scores read from a finished "
            "strategy=none run of the same config and seed (its summary.json) instead of "
            "scored again (greedy decoding of the same program: the same numbers)"
        ),
    )
    train_limit: int | None = setting(None, "first N training examples (smoke runs)")
    val_limit: int | None = None
    test_limit: int | None = setting(
        None, "first N test examples better-together scores each stage on"
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.mmgrpo.model_path is None:
            raise ValueError("ExperimentConfig.mmgrpo.model_path must name a local HF checkpoint")
        for name in ("train_limit", "val_limit", "test_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ExperimentConfig.{name} must be >= 1 or null, got {value}")
        if self.prompt_state is not None and not Path(self.prompt_state).is_file():
            raise ValueError(f"ExperimentConfig.prompt_state={self.prompt_state!r} is not a file")
        stages = parse_strategy(self.strategy)
        if self.prompt_stage is not None:
            if not can_load_prompt_stage(self.strategy):
                raise ValueError(
                    f"ExperimentConfig.prompt_stage={self.prompt_stage!r} stands for a strategy's "
                    f"one prompt stage, first; strategy={self.strategy!r} has another shape"
                )
            if not Path(self.prompt_stage).is_file():
                raise ValueError(
                    f"ExperimentConfig.prompt_stage={self.prompt_stage!r} is not a file"
                )
        if self.start_scores is not None:
            if not stages:
                raise ValueError(
                    f"ExperimentConfig.start_scores={self.start_scores!r}: strategy='none' is "
                    "the run that scores the start stage; it reads no other run's scores"
                )
            StartScores.read(self.start_scores)  # one line naming the file, before the model
        if stages.count("w") > 1:
            raise ValueError(
                f"ExperimentConfig.strategy={self.strategy!r}: one weight stage at most (each "
                "mmGRPO run owns mmgrpo.run_dir)"
            )

    @property
    def prompts_dir(self) -> Path:
        return Path(self.prompt_opt.out_dir or Path(self.mmgrpo.run_dir) / "prompts")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    model_path: str = ""
    adapter_path: str | None = setting(None, "a PEFT adapter, e.g. <run_dir>/adapter")
    split: Literal["train", "dev", "test"] = "dev"
    limit: int | None = None
    max_completion_tokens: int = 512
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    out: str | None = setting(
        None, "predictions JSONL; default runs/eval-<task>-<split>-<time>.jsonl"
    )

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.model_path or not resolve_model_path(self.model_path).exists():
            raise ValueError(
                f"EvalConfig.model_path={self.model_path!r} is neither a checkpoint folder, a "
                f"GGUF file nor a fetched registry model ({sorted(MODELS)})"
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
        self.lms: list[EngineLM] = []

    def __call__(self, max_tokens: int, temperature: float = 0.0) -> EngineLM:
        lm = EngineLM.local(
            self.base,
            self.tokenizer,
            sampling=Sampling(max_tokens, temperature=temperature),
            stop_token_ids=self.stop,
        )
        self.lms.append(lm)
        return lm

    def close(self) -> None:
        for lm in self.lms:
            lm.close()


def _first(examples: list[Example], limit: int | None) -> list[Example]:
    return examples if limit is None else examples[:limit]


class Policy:
    """The checkpoint, the frozen-base LMs of the other roles, the task, and the policy's engine
    (mmGRPO trains through it and updates its weights; the greedy LM scores on it): what each
    command starts from."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        self.cfg = cfg
        for field in ("prompt_state", "prompt_stage"):  # another program's, or not JSON:
            if getattr(cfg, field) is not None:  # said before the model loads
                program, _ = TASKS.lookup(cfg.task.name, "TaskConfig.name").build(
                    cfg.task, _no_model
                )
                load_prompt_state(program, getattr(cfg, field), field)
        self.model, self.tokenizer, self.stop = load_policy(cfg.mmgrpo)
        self.frozen = FrozenBaseLMs(self.model, self.tokenizer, self.stop)
        sampler = cfg.mmgrpo.sampler
        self.engine = default_engine(self.model, self.stop, cfg.mmgrpo)
        self.greedy = EngineLM(
            self.engine,
            self.tokenizer,
            sampling=Sampling(sampler.max_completion_tokens, temperature=0.0),
            max_prompt_tokens=sampler.max_prompt_tokens,
            adapter_of=module_adapters(self.model),
        )
        try:
            self.task = build_task(cfg.task, self.frozen)
        except BaseException:
            self.close()
            raise
        if cfg.prompt_state is not None:
            load_prompt_state(self.task.program, cfg.prompt_state)
        self.trainset = _first(self.task.splits.train, cfg.train_limit)
        self.valset = _first(self.task.splits.dev, cfg.val_limit)
        self.testset = _first(self.task.splits.test, cfg.test_limit)

    def mmgrpo(self) -> MMGRPO:
        return MMGRPO(
            self.task.metric,
            self.cfg.mmgrpo,
            model=self.model,
            tokenizer=self.tokenizer,
            stop_token_ids=self.stop,
            engine=self.engine,
        )

    def mipro(self, out_dir: Path) -> MIPROv2:
        config = dataclasses.replace(self.cfg.prompt_opt, out_dir=str(out_dir))
        prompt_lm = external_or_local_lm(self.cfg.prompt_lm, self.frozen, "prompt model")
        return MIPROv2(self.task.metric, config, prompt_lm=prompt_lm, lm=self.greedy)

    def score(self, program: Module, examples: Sequence[Example]) -> float:
        return evaluate(program, examples, self.task.metric, self.greedy)

    def close(self) -> None:
        self.engine.close()
        self.frozen.close()


def _save_run(cfg: ExperimentConfig, run_dir: Path, program: Module | None) -> None:
    """The config that made a run, and the program's prompt state (when not written already)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if program is not None:
        program.save(run_dir / "program.json")
    (run_dir / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))


def preflight(cfg: ExperimentConfig) -> None:
    """What a training command would refuse, checked before the model is read: the size of the
    trainset against examples_per_step, the run directory, and whether the run fits the device
    (trainer.plan.check_fits)."""
    parallel.initialize(cfg.mmgrpo.distributed)  # before anything touches a device
    trainset = _first(load_splits(cfg.task).train, cfg.train_limit)
    if cfg.mmgrpo.examples_per_step > len(trainset):
        raise UserError(
            f"mmgrpo.examples_per_step={cfg.mmgrpo.examples_per_step} is larger than the "
            f"trainset of {cfg.task.name} ({len(trainset)} examples"
            f"{'' if cfg.train_limit is None else f', train_limit={cfg.train_limit}'})"
        )
    check_run_dir(cfg.mmgrpo)
    check_fits(cfg.mmgrpo)


def run_train(cfg: ExperimentConfig) -> dict[str, Any]:
    preflight(cfg)
    policy = Policy(cfg)
    try:
        optimizer = policy.mmgrpo()
        program = optimizer.compile(policy.task.program, policy.trainset, policy.valset)
    finally:
        policy.close()
    run_dir = Path(cfg.mmgrpo.run_dir)
    if parallel.is_main_process():
        _save_run(cfg, run_dir, program)
    return {**(optimizer.summary or {}), "run_dir": str(run_dir)}


class _NoModel:
    """An LM for a dry run: the budget reads the program's shape, never an LM."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a dry run called an LM")


def _no_model(max_tokens: int, temperature: float = 0.0) -> _NoModel:
    return _NoModel()


def load_prompt_state(program: Module, path: str, field: str = "prompt_state") -> None:
    """A prompt state file (`prompt_state=`, `prompt_stage=`) into the program; a file that is
    not JSON, or another program's, is one line naming the file."""
    try:
        program.load(path)
    except (OSError, ValueError) as err:  # json's errors are ValueErrors
        raise UserError(
            f"ExperimentConfig.{field}={path!r} cannot be loaded into the program: {err}"
        ) from None


def dry_run_budget(config_file: str | None, overrides: Sequence[str], out: TextIO) -> int:
    """`optimize-prompts --dry-run`: MIPROv2's budget from the task, the split sizes and the
    prompt_opt section alone; no checkpoint is read (model_path need not be on this machine)."""
    tree = config_tree(config_file, overrides)
    if not isinstance(tree, dict):
        raise UserError(f"the config must be a mapping, got {tree!r}")
    task_cfg = build_config(TaskConfig, tree.get("task", {}), "task.")
    prompt_cfg = build_config(PromptOptConfig, tree.get("prompt_opt", {}), "prompt_opt.")
    task = build_task(task_cfg, _no_model)
    trainset = _first(task.splits.train, tree.get("train_limit"))
    valset = _first(task.splits.dev, tree.get("val_limit"))
    mipro = MIPROv2(task.metric, prompt_cfg, prompt_lm=_NoModel(), lm=_NoModel())
    mipro.compile(task.program, trainset, valset, dry_run=True, out=out)
    print(json.dumps({"dry_run": True}, indent=2), file=out)
    return 0


def run_optimize_prompts(cfg: ExperimentConfig, *, out: TextIO | None = None) -> dict[str, Any]:
    """MIPROv2 on the task; writes prompt_state.json (for `prompt_state=`) and trials.jsonl."""
    policy = Policy(cfg)
    try:
        optimizer = policy.mipro(cfg.prompts_dir)
        optimizer.compile(policy.task.program, policy.trainset, policy.valset, out=out)
        default = next(r for r in optimizer.result.trial_log if r["trial"] == 0)
        result = {
            "valset_default": default["score"],
            "valset_chosen": optimizer.result.score,
            "program_runs": optimizer.runs,
            "prompt_state": str(cfg.prompts_dir / "prompt_state.json"),
        }
    finally:
        policy.close()
    _save_run(cfg, cfg.prompts_dir, None)  # MIPROv2 wrote prompt_state.json and trials.jsonl
    return result


def run_better_together(cfg: ExperimentConfig) -> dict[str, Any]:
    """The strategy's stages; the best stage's prompts and adapter are saved under best/, and
    summary.json holds every stage's valset and test scores (what a sweep reads)."""
    started = time.monotonic()
    run_dir = Path(cfg.mmgrpo.run_dir)
    if "w" in parse_strategy(cfg.strategy):
        preflight(cfg)
    policy = Policy(cfg)
    try:
        weights = policy.mmgrpo()
        if cfg.prompt_stage is None:
            prompts: Optimizer = policy.mipro(cfg.prompts_dir)
        else:
            prompts = LoadedPrompts(json.loads(Path(cfg.prompt_stage).read_text()))
        start = None if cfg.start_scores is None else StartScores.read(cfg.start_scores)
        together = BetterTogether(
            policy.score,
            prompts,
            weights,
            seed=cfg.mmgrpo.seed,
        )
        program = together.compile(
            policy.task.program,
            policy.trainset,
            policy.valset,
            cfg.strategy,
            start_score=None if start is None else start.valset,
        )
        best_index = together.best_index  # the stage compile returned
        best = together.stages[best_index]
        test_scores = None
        if policy.testset:
            known = None if start is None else start.test
            test_scores = _stage_test_scores(policy, program, together, known)
        best_dir = run_dir / "best"
        if cfg.mmgrpo.train == "lora":
            # the restored stage's weights, naming the base they were trained on
            save_peft_adapter(policy.model, best_dir / "adapter", cfg.mmgrpo.model_path or "")
    finally:
        policy.close()
    _save_run(cfg, best_dir, program)
    stages = [
        {"stage": s.name, "valset": s.score, "test": t}
        for s, t in zip(together.stages, test_scores or [None] * len(together.stages), strict=True)
    ]
    result = {
        "strategy": cfg.strategy,
        "prompt_stage": cfg.prompt_stage,  # where the p stage was read from, if not searched
        "start_scores": cfg.start_scores,  # where the start's scores were read from, if not scored
        "stages": stages,
        "best": best.name,
        "best_index": best_index,
        "best_dir": str(best_dir),
    }
    (best_dir / "better_together.json").write_text(json.dumps(result, indent=2))
    if parallel.is_main_process():
        _write_together_summary(run_dir, result, time.monotonic() - started)
    return result


def _stage_test_scores(
    policy: Policy, program: Module, together: BetterTogether, start_test: float | None = None
) -> list[float]:
    """Every stage's program (its prompts and weights) scored on the test split, which no stage
    saw (the start's read instead, when `start_test` is known); the stage `compile` returned is
    restored after."""
    scores = []
    for index, stage in enumerate(together.stages):
        if index == 0 and start_test is not None:
            scores.append(start_test)
            continue
        program.load_state(stage.prompt_state)
        together.weights.restore_weights(stage.weights)
        scores.append(policy.score(program, policy.testset))
    best = together.stages[together.best_index]
    program.load_state(best.prompt_state)
    together.weights.restore_weights(best.weights)
    return scores


def _write_together_summary(run_dir: Path, result: dict[str, Any], seconds: float) -> None:
    """summary.json of a better-together run, the way a sweep reads a run: the start and the
    chosen stage on the valset (`valset_*`) and on the test split (`test_*`), per stage too;
    the weight stage's own summary (it wrote summary.json first) kept under `weight_stage`."""
    path = run_dir / "summary.json"
    weight_stage = json.loads(path.read_text()) if path.is_file() else None
    start = result["stages"][0]
    chosen = result["stages"][result["best_index"]]
    summary: dict[str, Any] = {
        **result,
        "valset_start": start["valset"],
        "valset_after": chosen["valset"],
        "valset_gain": chosen["valset"] - start["valset"],
        "test_start": start["test"],
        "test_after": chosen["test"],
        "test_gain": None if start["test"] is None else chosen["test"] - start["test"],
        "wall_seconds": seconds,
        "weight_stage": weight_stage,
    }
    write_atomic(path, json.dumps(summary, indent=2))


def load_eval_policy(cfg: EvalConfig) -> tuple[Decoder, HFTokenizer, tuple[int, ...]]:
    lora = None if cfg.adapter_path is None else adapter_lora_config(cfg.adapter_path)
    model, tokenizer, stop = load_checkpoint(cfg.model_path, dtype=jnp.dtype(cfg.dtype), lora=lora)
    if cfg.adapter_path is not None:
        load_peft_adapter(model, cfg.adapter_path, base_model=cfg.model_path)
    return model, tokenizer, stop


def evaluate_task(
    task: Task, examples: list[Example], lm: EngineLM, out: Path, progress: bool = True
) -> dict[str, Any]:
    """Greedy run over `examples`; failures score 0; one JSONL line per example (with each
    call's module and reply, to see where a program went wrong), written as each finishes (an
    interrupted evaluation keeps those), in example order once all are in."""

    def record(t: Trajectory) -> str:
        example = examples[t.example_index]
        line = {
            "index": t.example_index,
            "inputs": example.inputs(),
            "labels": example.labels(),
            "prediction": None if t.prediction is None else dict(t.prediction),
            "score": t.reward,
            "status": t.status,
            "error": t.error,
            "calls": [{"module": c.predictor, "reply": c.completion} for c in t.calls],
        }
        return json.dumps(line, ensure_ascii=False, default=str) + "\n"

    with out.open("w", encoding="utf-8") as f:
        kept = [0]

        def keep(t: Trajectory) -> None:
            f.write(record(t))
            f.flush()
            kept[0] += 1

        try:
            trajectories = score_examples(
                task.program, examples, task.metric, lm=lm, progress=progress, on_result=keep
            )
        except KeyboardInterrupt as err:
            err.add_note(f"{kept[0]} of {len(examples)} predictions kept in {str(out)!r}")
            raise
    out.write_text("".join(record(t) for t in trajectories), encoding="utf-8")
    counts = summarize(trajectories)
    return {
        "metric": counts["reward_mean"],
        "examples": len(trajectories),
        "format_failures": counts["status_format_failure"],
        "errors": counts["status_error"],
        "predictions": str(out),
    }


def writable_output(path: Path) -> Path:
    """`path`, after making sure a file can be written there (before hours of evaluation)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as err:
        raise UserError(f"EvalConfig.out={str(path)!r} cannot be written: {err.strerror}") from None
    return path


def run_eval(cfg: EvalConfig, progress: bool = True) -> dict[str, Any]:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    splits = load_splits(cfg.task)  # data that cannot be read: refused before anything is made
    out = writable_output(Path(cfg.out or f"runs/eval-{cfg.task.name}-{cfg.split}-{stamp}.jsonl"))
    model, tokenizer, stop = load_eval_policy(cfg)
    frozen = FrozenBaseLMs(model, tokenizer, stop)
    policy = EngineLM.local(
        model,
        tokenizer,
        sampling=Sampling(cfg.max_completion_tokens, temperature=0.0),
        stop_token_ids=stop,
    )
    try:
        task = build_task(cfg.task, frozen, splits)
        examples = _first(task.splits.get(cfg.split), cfg.limit)
        result = evaluate_task(task, examples, policy, out, progress)
    finally:
        policy.close()
        frozen.close()
    return {"task": cfg.task.name, "split": cfg.split, **result}


COMMANDS = {
    "train": run_train,
    "optimize-prompts": run_optimize_prompts,
    "better-together": run_better_together,
}


def main(command: str, config: ExperimentConfig | EvalConfig, out: TextIO, **options: Any) -> int:
    if command == "optimize-prompts":
        options["out"] = out  # the budget line goes where the result goes
    distributed = getattr(getattr(config, "mmgrpo", None), "distributed", None)
    if distributed is not None and distributed.enabled and command != "train":
        raise UserError(
            f"mmgrpo.distributed (num_processes={distributed.num_processes}) is supported by "
            f"`mmgrpo train` only, not by `mmgrpo {command}`"
        )
    run = run_eval if command == "eval" else COMMANDS[command]
    try:
        result = run(config, **options)
    except (UserError, KeyboardInterrupt) as err:
        if command != "eval":
            _as_cli_keys(err)
        raise
    print(json.dumps(result, indent=2), file=out)
    return 0


def train_command(config: ExperimentConfig, out: TextIO) -> int:
    return main("train", config, out)


def optimize_prompts_command(config: ExperimentConfig, out: TextIO) -> int:
    return main("optimize-prompts", config, out)


def better_together_command(config: ExperimentConfig, out: TextIO) -> int:
    return main("better-together", config, out)


def eval_command(config: EvalConfig, out: TextIO) -> int:
    return main("eval", config, out)


# the trainer names its own keys (`resume=true continues the run`); on these commands they sit
# under `mmgrpo.`, and a user who types what the message says must be understood
_TRAINER_KEYS = re.compile(r"(?<![\w.])(resume|run_dir)=")


def _as_cli_keys(err: BaseException) -> None:
    """The trainer's `resume=` and `run_dir=` in an error and its notes, as `mmgrpo.` keys."""

    def keyed(text: Any) -> Any:
        return _TRAINER_KEYS.sub(r"mmgrpo.\1=", text) if isinstance(text, str) else text

    err.args = tuple(keyed(a) for a in err.args)
    if hasattr(err, "__notes__"):
        err.__notes__[:] = [keyed(n) for n in err.__notes__]
