import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_gpu_suite_runs_every_check_on_cpu_at_the_tiny_preset():
    """~1-2 minutes on 2 cores (every stage compiles): slow-marked to keep `make test` short."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--preset", "tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    table = out[out.index("| check | value |") :]
    for row in ("plan: train step", "train tokens/s", "train MFU", "decode HBM bandwidth share"):
        assert f"| {row}" in table
    assert "| mmGRPO end to end: 3 steps, s |" in table
    assert "| fits | yes |" in out  # the plan's own table comes first
