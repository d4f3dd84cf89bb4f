"""`mmgrpo demo` (= `make demo`): mmGRPO trains a tiny from-scratch policy on a CPU testbed.

A 2-layer Llama-architecture model with a word-level vocabulary of the task's words is trained
in full (no LoRA: nothing is pretrained) with module-level (default) or trajectory-level
grouping, on the two-door program by default or another `programs.testbeds` program. The run
directory gets metrics.jsonl, TensorBoard events, learning_curve.png, orbax checkpoints and
summary.json with the greedy eval reward before and after.

`method` runs the paper's Table 1 alternatives on the same program and policy instead: the
program as written (`vanilla`), MIPROv2 prompt optimization (`prompt_opt`) and BetterTogether
(`better_together`: MIPROv2, then mmGRPO on its prompts; the mmGRPO run lives in
`<run_dir>/weights`). Their prompt model is scripted (`testing.word_prompt_model`): it writes
instructions from the task's words, the only words a word policy can read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from transformers import PreTrainedTokenizerFast

from mmgrpo_jax import parallel
from mmgrpo_jax.config_files import config_tree, setting
from mmgrpo_jax.engines.base import Sampling
from mmgrpo_jax.engines.lm import EngineLM
from mmgrpo_jax.errors import UserError, check_field_types
from mmgrpo_jax.program import Module
from mmgrpo_jax.prompt_opt.better_together import BetterTogether
from mmgrpo_jax.prompt_opt.mipro import MIPROv2, PromptOptConfig
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.rl.rollout import quiet_failure_warnings
from mmgrpo_jax.testing import word_policy, word_prompt_model
from mmgrpo_jax.trainer.config import (
    DistributedConfig,
    MMGRPOConfig,
    OptimConfig,
    ParallelConfig,
    SamplerConfig,
    changed_keys,
    describe_changes,
)
from mmgrpo_jax.trainer.mmgrpo import MMGRPO, evaluate
from mmgrpo_jax.trainer.policy import default_engine
from mmgrpo_jax.trainer.run import check_run_dir
from mmgrpo_jax.trainer.run_lock import RunLock
from mmgrpo_jax.trainer.run_log import read_json, write_atomic
from models.config import ModelConfig
from models.decoder import Decoder
from models.tokenizer import UNKNOWN_WORDS
from programs.testbeds import Testbed, testbed

logger = logging.getLogger(__name__)

# Table 1's methods; "mmgrpo" is the demo itself
METHODS = ("mmgrpo", "vanilla", "prompt_opt", "better_together")
# what a method run may change and still keep its finished summary
RESUME_FREE = ("run_dir", "resume", "progress")
# the demo fields the policy is built from, which MMGRPOConfig (checked on resume) does not hold
POLICY_FIELDS = ("testbed", "hidden_size", "num_layers", "head_scale", "unknown_words")
SETTINGS_FILE = "demo.json"  # in a run_dir: the settings the run was started with
# not a run's settings: where it runs, how it is shown, its devices
UNRECORDED = ("run_dir", "resume", "progress", "parallel", "distributed")


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    testbed: str = setting("two_doors", "a programs.testbeds name")
    method: str = setting("mmgrpo", "or Table 1's vanilla | prompt_opt | better_together")
    prompt_candidates: int = setting(6, "prompt_opt, better_together: instructions and demo sets")
    grouping: str = "module"
    num_steps: int = 150
    num_rollouts: int = 8
    examples_per_step: int = 16
    lr: float = 1e-2
    align: str = setting("truncate", "how module-level groups line up unequal invocation counts")
    loss: str = "grpo"
    epsilon_high: float | None = None
    beta: float = setting(
        0.04,
        (
            "k3 KL to a frozen copy of the initial (near-uniform) weights: it keeps some "
            "mass on every reply, so no clue turns deterministic on a wrong one before its "
            "right reply was sampled"
        ),
    )
    format_failure_score: float = -1.0
    hidden_size: int = 32
    num_layers: int = 2
    seed: int = 0
    head_scale: float = setting(
        0.25,
        (
            "the output head's init relative to LeCun's: small, so no seed starts with "
            "almost no mass on the replies that parse (testing.word_policy)"
        ),
    )
    unknown_words: str = setting(
        "drop",
        (
            "what the policy reads of a prompt's words outside its vocabulary "
            '(build_word_tokenizer): "drop" leaves them out, "unk" reads each as [UNK] (the'
            " demo before 2026-12-02)"
        ),
    )
    checkpoint_every: int = 50
    samples_per_step: int = setting(
        2, ("examples a step whose calls go to samples.jsonl (-1: all; `mmgrpo samples RUN_DIR`)")
    )
    run_dir: str | None = setting(None, "default: a new runs/demo-<time>-<suffix>")
    resume: bool = setting(False, "continue the run in run_dir from its newest checkpoint")
    progress: bool = True
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    distributed: DistributedConfig = setting(
        note=(
            "several processes: each runs the same command with its process_id and the same run_dir"
        ),
        factory=DistributedConfig,
    )

    def __post_init__(self) -> None:
        """Every value is checked here, before a model is built: the trainer's own checks run
        on the config this demo would hand it."""
        check_field_types(self)
        try:
            testbed(self.testbed)
        except ValueError as err:
            raise ValueError(f"DemoConfig.{err}") from None
        if self.method not in METHODS:
            raise ValueError(f"DemoConfig.method must be one of {METHODS}, got {self.method!r}")
        if self.prompt_candidates < 2:
            raise ValueError(
                f"DemoConfig.prompt_candidates must be >= 2, got {self.prompt_candidates}"
            )
        if self.grouping not in ("module", "trajectory"):
            raise ValueError(
                f"DemoConfig.grouping must be 'module' or 'trajectory', got {self.grouping!r}"
            )
        if self.unknown_words not in UNKNOWN_WORDS:
            raise ValueError(
                f"DemoConfig.unknown_words must be one of {UNKNOWN_WORDS}, "
                f"got {self.unknown_words!r}"
            )
        if not self.head_scale >= 0:
            raise ValueError(f"DemoConfig.head_scale must be >= 0, got {self.head_scale}")
        for name in ("num_steps", "num_rollouts", "examples_per_step", "hidden_size", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.resume and self.run_dir is None:
            raise ValueError("DemoConfig.resume=true needs the run_dir of the run to continue")
        if self.distributed.enabled and self.run_dir is None:
            raise ValueError(
                "DemoConfig.distributed: the processes of one run share a run_dir; set run_dir"
            )
        if self.distributed.enabled and self.method != "mmgrpo":
            raise ValueError(
                f"DemoConfig.distributed runs method='mmgrpo' only, got method={self.method!r}"
            )
        examples = len(testbed(self.testbed).trainset())
        if self.examples_per_step > examples:
            raise ValueError(
                f"DemoConfig.examples_per_step must be <= {examples} (the {self.testbed} "
                f"trainset), got {self.examples_per_step}"
            )
        try:
            # the head layout is what can be wrong; the vocabulary's size does not enter it
            ModelConfig.tiny(len(testbed(self.testbed).vocabulary), hidden_size=self.hidden_size)
            mmgrpo_config(self, self.run_dir or "runs/demo")
        except ValueError as err:
            raise ValueError(f"DemoConfig: {err}") from None


def tiny_policy(config: DemoConfig) -> tuple[Decoder, PreTrainedTokenizerFast]:
    """A from-scratch Llama-architecture decoder over a word vocabulary of the task's words."""
    return word_policy(
        testbed(config.testbed).vocabulary,
        hidden_size=config.hidden_size,
        num_layers=config.num_layers,
        seed=config.seed,
        head_scale=config.head_scale,
        unknown=config.unknown_words,
    )


def mmgrpo_config(config: DemoConfig, run_dir: str | Path) -> MMGRPOConfig:
    return MMGRPOConfig(
        grouping=config.grouping,
        align=config.align,
        num_rollouts=config.num_rollouts,
        examples_per_step=config.examples_per_step,
        num_steps=config.num_steps,
        format_failure_score=config.format_failure_score,
        train="full",
        loss=LossConfig(config.loss, epsilon_high=config.epsilon_high, beta=config.beta),
        optim=OptimConfig(lr=config.lr, decay="linear", micro_batch_size=128),
        eval_every=10,
        checkpoint_every=config.checkpoint_every,
        samples_per_step=config.samples_per_step,
        seed=config.seed,
        run_dir=str(run_dir),
        resume=config.resume,
        # one word: the bare predictors' whole reply
        sampler=SamplerConfig(max_completion_tokens=1, batch=128, max_wait_s=1.0),
        progress=config.progress,
        parallel=config.parallel,
        distributed=config.distributed,
    )


def new_run_dir(parent: str | Path = "runs") -> Path:
    """A run directory no other run has: the time, and a suffix that is unique even for runs
    started in the same second (the directory is created here, atomically)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    Path(parent).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"demo-{stamp}-", dir=parent))


def run_demo(config: DemoConfig) -> dict[str, Any]:
    """Train (or run `config.method`) and return summary.json's content."""
    run_dir = Path(config.run_dir) if config.run_dir else new_run_dir()
    if config.method != "mmgrpo":
        return run_method(config, run_dir)
    settings = mmgrpo_config(config, run_dir)
    parallel.initialize(settings.distributed)  # before anything touches a device
    check_run_dir(settings)  # before the model is built
    if parallel.is_main_process():
        with RunLock(run_dir):
            record_policy(config, run_dir)
            record_settings(config, run_dir)
    model, tokenizer = tiny_policy(config)
    bed = testbed(config.testbed)
    optimizer = MMGRPO(
        bed.metric,
        settings,
        model=model,
        tokenizer=tokenizer,
        stop_token_ids=[tokenizer.eos_token_id],
    )
    optimizer.compile(bed.program(), bed.trainset(), bed.valset())
    return {**optimizer.summary, "run_dir": str(run_dir)}


def record_settings(config: DemoConfig, run_dir: Path) -> None:
    """Write the settings a run starts with to run_dir/demo.json (once: a resume keeps the
    first), so that `resume=true` continues the run as it was started (resume_overrides)."""
    path = run_dir / SETTINGS_FILE
    if not path.is_file():
        settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNRECORDED}
        write_atomic(path, json.dumps(settings, indent=2))


def resume_overrides(config_file: str | None, overrides: Sequence[str]) -> list[str]:
    """For `resume=true`: the settings recorded in run_dir that neither the YAML file nor an
    override gives, as overrides to put first (a resume continues the run as it was started;
    what the user gives wins, and the trainer says or refuses each change)."""
    tree = config_tree(config_file, overrides)
    if tree.get("resume") is not True or not tree.get("run_dir"):
        return []
    run_dir = Path(str(tree["run_dir"]))
    recorded: dict[str, Any] = {}
    for name in ("policy.json", SETTINGS_FILE):  # policy.json alone: a run before demo.json
        if (run_dir / name).is_file():
            recorded.update(read_json(run_dir / name, "restore it or choose another run_dir"))
    kept = {k: v for k, v in recorded.items() if k not in tree}
    if kept:
        listed = ", ".join(f"{k}={v}" for k, v in kept.items())
        logger.warning(
            "resuming %s with the settings it was started with (%s); give key=value to change one",
            run_dir,
            listed,
        )
    return [f"{k}={json.dumps(v)}" for k, v in kept.items()]


def record_policy(config: DemoConfig, run_dir: Path) -> None:
    """Write the policy's demo fields to run_dir/policy.json, or refuse to resume a run whose
    checkpoints were trained on another policy (its weights would be read another way)."""
    path = run_dir / "policy.json"
    settings = {name: getattr(config, name) for name in POLICY_FIELDS}
    if path.is_file():
        old = read_json(
            path,
            "it records the policy of the run in this run_dir; restore it "
            "or choose another run_dir",
        )
        changed = changed_keys(old, settings)
        if changed:
            raise UserError(
                f"run_dir={str(run_dir)!r} holds a run of another policy "
                f"({describe_changes(old, settings, changed)}): resume it with its own settings, "
                "or choose another run_dir"
            )
        return
    if config.resume and (run_dir / "checkpoints").is_dir():
        logger.warning(
            "%s has no policy.json (a run from before 2026-12-02): its policy settings %s "
            "cannot be checked; recording this run's",
            run_dir,
            list(POLICY_FIELDS),
        )
    write_atomic(path, json.dumps(settings, indent=2))


def run_method(config: DemoConfig, run_dir: Path) -> dict[str, Any]:
    """A Table 1 alternative to the demo's mmGRPO run, scored like it (greedy eval reward on
    the valset before and after) into the same summary.json, so a sweep compares them.
    A finished one is not redone: with resume=true (and the same settings) its summary is
    returned, without it the run_dir is refused."""
    bed = testbed(config.testbed)
    stage_config = mmgrpo_config(config, run_dir / "weights")  # better_together's mmGRPO stage
    finished = run_dir / "summary.json"
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in RESUME_FREE}
    with RunLock(run_dir):
        if finished.is_file():
            return {**finished_method(finished, settings, config.resume), "run_dir": str(run_dir)}
        record_settings(config, run_dir)
        if config.method == "better_together":
            check_run_dir(stage_config)
        start = time.perf_counter()
        model, tokenizer = tiny_policy(config)
        engine = default_engine(model, [tokenizer.eos_token_id], stage_config)
        greedy = EngineLM(engine, tokenizer, sampling=Sampling(1, temperature=0.0))
        run = MethodRun(config, bed, model, tokenizer, engine, greedy, stage_config)
        try:
            program, valset = bed.program(), bed.valset()
            before = run.score(program, valset)
            details: dict[str, Any] = {}
            # MIPROv2 prints its budget; stdout is for the summary's JSON
            with contextlib.redirect_stdout(sys.stderr):
                program = optimized(run, program, details)
            after = run.score(program, valset)
        finally:
            engine.close()
        summary = {
            "method": config.method,
            "eval_reward_before": before,
            "eval_reward_after": after,
            "wall_seconds": time.perf_counter() - start,
            **details,
            "settings": settings,
        }
        write_atomic(finished, json.dumps(summary, indent=2))
    return {**summary, "run_dir": str(run_dir)}


def finished_method(path: Path, settings: dict[str, Any], resume: bool) -> dict[str, Any]:
    """A finished method run's summary, if this config may keep it."""
    if not resume:
        raise UserError(
            f"run_dir={str(path.parent)!r} already holds a finished run (summary.json): choose "
            "another run_dir, or set resume=true to keep it"
        )
    summary = read_json(path, "remove the run_dir to redo the run")
    old = summary.get("settings", {})
    changed = changed_keys(old, settings)
    if changed:
        diff = describe_changes(old, settings, changed)
        raise UserError(
            f"run_dir={str(path.parent)!r} holds a finished run of other settings ({diff}): "
            "choose another run_dir"
        )
    return summary


@dataclasses.dataclass(frozen=True)
class MethodRun:
    """What a Table 1 method works with: the policy, the engine it samples and is scored on."""

    config: DemoConfig
    bed: Testbed
    model: Decoder
    tokenizer: PreTrainedTokenizerFast
    engine: Any  # the JaxEngine the greedy LM reads and mmGRPO trains
    greedy: EngineLM
    stage_config: MMGRPOConfig  # better_together's mmGRPO stage

    def score(self, program: Module, examples: list) -> float:
        return evaluate(program, examples, self.bed.metric, self.greedy)


def optimized(run: MethodRun, program: Module, details: dict[str, Any]) -> Module:
    """`program` after `run.config.method` (vanilla: as written); `details` gets its report."""
    config, bed = run.config, run.bed
    if config.method == "prompt_opt":
        optimizer = prompt_optimizer(config, bed, run.greedy)
        return optimizer.compile(program, bed.trainset(), bed.valset())
    if config.method == "better_together":
        mmgrpo = MMGRPO(
            bed.metric,
            run.stage_config,
            model=run.model,
            tokenizer=run.tokenizer,
            stop_token_ids=[run.tokenizer.eos_token_id],
            engine=run.engine,
        )
        together = BetterTogether(
            run.score, prompt_optimizer(config, bed, run.greedy), mmgrpo, seed=config.seed
        )
        # BetterTogether returns its best stage on the valset (here the test set too), so its
        # score is never below the program as written; mmGRPO's is its last eval, unselected
        program = together.compile(program, bed.trainset(), bed.valset(), "p -> w")
        details["stages"] = {stage.name: stage.score for stage in together.stages}
    return program


def prompt_optimizer(config: DemoConfig, bed: Testbed, lm: EngineLM) -> MIPROv2:
    """MIPROv2 with a scripted prompt model; candidates are scored by the greedy policy."""
    settings = PromptOptConfig(
        auto=None,
        num_candidates=config.prompt_candidates,
        bootstrap_pool=len(bed.trainset()),
        seed=config.seed,
    )
    return MIPROv2(
        bed.metric, settings, prompt_lm=word_prompt_model(bed.vocabulary, config.seed), lm=lm
    )


def main(config: DemoConfig, out: TextIO) -> int:
    with quiet_failure_warnings():  # a random policy's parse failures are expected
        summary = run_demo(config)
    print(json.dumps(summary, indent=2), file=out)
    return 0
