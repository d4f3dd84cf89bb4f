"""`mmgrpo sweep` over the real demo: killed mid-run, started again, the same table."""

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["num_steps=4", "examples_per_step=4", "num_rollouts=2", "hidden_size=8"]


def _sweep(out: Path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "mmgrpo_jax.cli",
        "sweep",
        "--command",
        "demo",
        "--grid",
        "grouping=module,trajectory",
        "--seeds",
        "0",
        "--out",
        str(out),
        "--threshold",
        "0.5",
        *TINY,
        "checkpoint_every=1",
    ]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _rows(path: Path) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(path.read_text())))
    for row in rows:
        for key in ("wall_seconds", "wall_seconds_mean", "run_dir"):
            row.pop(key, None)
    return rows


@pytest.mark.slow
def test_a_killed_demo_sweep_resumes_to_the_table_of_an_uninterrupted_one(tmp_path):
    reference = _sweep(tmp_path / "reference")
    _, stderr = reference.communicate(timeout=900)
    assert reference.returncode == 0, stderr
    interrupted = _sweep(tmp_path / "interrupted")
    steps = tmp_path / "interrupted" / "runs" / "grouping-module" / "seed0" / "checkpoints"
    deadline = time.monotonic() + 600
    while not (steps / "2").is_dir():  # the first run is past its second checkpoint
        assert time.monotonic() < deadline and interrupted.poll() is None
        time.sleep(0.1)
    interrupted.kill()
    interrupted.wait()
    restarted = _sweep(tmp_path / "interrupted")
    _, stderr = restarted.communicate(timeout=900)
    assert restarted.returncode == 0, stderr
    log = steps.parent / "sweep.log"
    assert log.read_text().count("=== ") == 2  # the killed run was resumed, not redone
    for name in ("table.csv", "runs.csv"):
        assert _rows(tmp_path / "interrupted" / name) == _rows(tmp_path / "reference" / name)
    for grouping in ("module", "trajectory"):
        metrics = Path("runs") / f"grouping-{grouping}" / "seed0" / "metrics.jsonl"
        killed = (tmp_path / "interrupted" / metrics).read_text().splitlines()
        clean = (tmp_path / "reference" / metrics).read_text().splitlines()
        assert [_losses(x) for x in killed] == [_losses(x) for x in clean], grouping


def _losses(line: str) -> tuple:
    row = json.loads(line)
    return tuple(
        (k, round(v, 6))
        for k, v in sorted(row.items())
        if not k.startswith(("time/", "perf/")) and "per_s" not in k and k != "wall_seconds"
    )
