"""Run logging: metrics.jsonl (always), TensorBoard and a learning-curve PNG when their libraries
are installed (a GPU box may lack them: that is said once, not ignored), and summary.json.

A resumed run continues the log of the run it resumes: rows of steps after the checkpoint (they
are replayed) are dropped from metrics.jsonl and samples.jsonl and purged from TensorBoard, so
every step has one row, and the summary and the curve cover the whole run across processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from mmgrpo_jax.errors import UserError

SAMPLES_FILE = "samples.jsonl"  # trainer.samples: a step's calls, rewards and advantages

logger = logging.getLogger(__name__)


class RunLogError(UserError):
    """A run file that cannot be written (metrics.jsonl, TensorBoard events): the run stops,
    with the state of its last completed step saved (MMGRPO.compile)."""


def read_rows(path: Path) -> list[dict[str, float]]:
    """The rows of a metrics.jsonl; a line cut short by a kill is dropped with a warning."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("%s line %d is cut short (a killed write?): dropped", path, number)
    return rows


class RunLogger:
    """`resumed_step`: the step of the checkpoint a resumed run starts from (None: a fresh run,
    which starts the log anew); `elapsed`: the wall seconds the run had spent before it;
    `unwritten`: rows the run could not write before it stopped (the checkpoint keeps them:
    `self.unwritten`); `writes=False` (every process of a multi-process run but the first)
    keeps the history in memory only."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        *,
        resumed_step: int | None = None,
        elapsed: float = 0.0,
        unwritten: Sequence[Mapping[str, float]] = (),
        writes: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.writes = writes
        if writes:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.history: list[dict[str, float]] = []
        if resumed_step is not None and self.metrics_path.is_file():
            rows = read_rows(self.metrics_path)
            # rows logged at x <= the checkpoint's step describe state it holds
            self.history = [r for r in rows if r.get("step", 0) <= resumed_step]
        self.history += [dict(r) for r in unwritten if r not in self.history]
        self.unwritten: list[dict[str, float]] = []
        self.samples_path = self.run_dir / SAMPLES_FILE
        if writes:
            self._rewrite()
            self._keep_samples(resumed_step)
        self.started = time.perf_counter() - elapsed
        self._writer = None
        if tensorboard and writes:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                logger.warning("TensorBoard logging is off: tensorboardX is not installed")
            else:
                # TensorBoard hides the events at steps >= purge_step written before this point
                purge = None if resumed_step is None else resumed_step + 1
                self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

    @property
    def elapsed(self) -> float:
        """Wall seconds of the run so far, earlier processes of a resumed run included."""
        return time.perf_counter() - self.started

    def has(self, key: str, step: int) -> bool:
        """Whether a row logged at `step` holds `key` (an evaluation a resume need not redo)."""
        return any(r.get("step") == step and key in r for r in self.history)

    def _rewrite(self) -> None:
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.history))
        tmp.replace(self.metrics_path)

    def _keep_samples(self, resumed_step: int | None) -> None:
        """A fresh run starts samples.jsonl anew; a resumed one keeps the steps its checkpoint
        holds (the later ones are sampled again)."""
        kept = []
        if resumed_step is not None and self.samples_path.is_file():
            kept = [r for r in read_rows(self.samples_path) if r.get("step", 0) <= resumed_step]
        if kept or self.samples_path.is_file():
            write_atomic(self.samples_path, "".join(json.dumps(r) + "\n" for r in kept))

    def log_samples(self, records: Sequence[Mapping[str, Any]]) -> None:
        """A step's samples (trainer.samples) into samples.jsonl, and into TensorBoard as text."""
        if not self.writes or not records:
            return
        with _writing(self.samples_path), self.samples_path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
        if self._writer is not None:
            step = int(records[0]["step"])
            with _writing(self.run_dir / "tensorboard"):
                self._writer.add_text("samples", samples_markdown(records), step)
                self._writer.flush()

    def log(self, record: Mapping[str, float]) -> None:
        record = {k: float(v) for k, v in record.items()}
        self.history.append(record)
        if not self.writes:
            return
        try:
            with _writing(self.metrics_path), self.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        except RunLogError:
            self.unwritten.append(record)  # the checkpoint keeps it for the resume
            raise
        if self._writer is not None:
            step = int(record.get("step", len(self.history)))
            with _writing(self.run_dir / "tensorboard"):
                for key, value in record.items():
                    if key != "step" and math.isfinite(value):
                        self._writer.add_scalar(key, value, step)
                self._writer.flush()

    def close(self, summary: Mapping[str, Any]) -> dict[str, Any]:
        """Write summary.json (with eval before/after and wall time) and the curve PNG."""
        evals = [r["eval_reward"] for r in self.history if "eval_reward" in r]
        full = {
            "eval_reward_before": evals[0] if evals else None,
            "eval_reward_after": evals[-1] if evals else None,
            # what training added on the eval split (a sweep's score for a pretrained policy,
            # whose start is not 0)
            "eval_reward_gain": evals[-1] - evals[0] if evals else None,
            "wall_seconds": self.elapsed,
            **summary,
        }
        if not self.writes:
            return full
        # atomic: summary.json is how a sweep (or a resume) knows the run finished
        path = self.run_dir / "summary.json"
        with _writing(path):
            write_atomic(path, json.dumps(full, indent=2))
        self._plot()
        if self._writer is not None:
            self._writer.close()
        return full

    def _plot(self) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            logger.warning("no learning-curve PNG: matplotlib is not installed")
            return
        fig, ax = plt.subplots(figsize=(6, 4))
        for key, label in (
            ("reward_mean", "train reward (sampled)"),
            ("eval_reward", "eval reward (greedy)"),
        ):
            points = [(r["step"], r[key]) for r in self.history if key in r]
            if points:
                ax.plot(
                    *zip(*points, strict=True),
                    marker="o" if key == "eval_reward" else None,
                    label=label,
                )
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.run_dir / "learning_curve.png", dpi=120)
        plt.close(fig)


def samples_markdown(records: Sequence[Mapping[str, Any]]) -> str:
    """A step's samples as a markdown table (TensorBoard's text tab renders it)."""
    lines = [
        "| example | rollout | call | group | reward | advantage | trained | reply |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in records:
        reply = " ".join(str(r["reply"]).split()).replace("|", "\\|")[:120]
        advantage = "" if r["advantage"] is None else f"{r['advantage']:+.3f}"
        group = "" if r["group"] is None else r["group"]
        lines.append(
            f"| {r['example']} | {r['rollout']} | {r['module']}[{r['invocation']}] | {group} "
            f"| {r['reward']:.3f} | {advantage} | {'yes' if r['trained'] else 'no'} | {reply} |"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """A write to a run file: an OSError is a RunLogError naming the file."""
    try:
        yield
    except OSError as err:
        raise RunLogError(f"{path} cannot be written ({err.strerror})") from None


def read_json(path: Path, remedy: str) -> Any:
    """A run folder's JSON file; one that cannot be read is a UserError naming it and `remedy`
    (what the user can do about it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:  # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{path} cannot be read ({type(err).__name__}: {err}): {remedy}") from None


def write_atomic(path: Path, text: str) -> None:
    """Write through a sibling file and rename, so a reader (or a kill) never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)
