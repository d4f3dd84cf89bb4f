import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE_DEVICES = "--xla_force_host_platform_device_count=8"  # tests/conftest.py sets it


@pytest.mark.slow
def test_the_gpu_suite_runs_every_check_on_cpu_at_the_tiny_preset():
    """~1-2 minutes on 2 cores (every stage compiles): slow-marked to keep `make test` short."""
    # the suite is a one-device script: without conftest's eight fake CPU devices, which its
    # end-to-end trainer would take as a data mesh that micro_batch_size=2 cannot split
    flags = os.environ.get("XLA_FLAGS", "").replace(FAKE_DEVICES, "").strip()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": flags}
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_suite.py", "--preset", "tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    table = out[out.index("| check | value |") :]
    for row in ("plan: train step", "train tokens/s", "train MFU", "decode HBM bandwidth share"):
        assert f"| {row}" in table
    assert "| mmGRPO end to end: 3 steps, s |" in table
    assert "| fits | yes |" in out  # the plan's own table comes first
