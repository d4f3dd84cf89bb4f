"""Every Python block of the README runs, in order, as one script (mktestdocs), in a fresh
folder: the quickstart trains on a tiny checkpoint it writes, and later blocks use its names.
A block that stops working (a renamed API, an undefined name) fails here."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_readmes_code_blocks_run(tmp_path):
    readme = str(REPO / "README.md")
    script = f"from mktestdocs import check_md_file; check_md_file({readme!r}, memory=True)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "runs" / "quickstart" / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "runs" / "together" / "summary.json").is_file()  # BetterTogether's w
