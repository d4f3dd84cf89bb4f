"""`mmgrpo sweep` whose runs are `fake_run.py` (a process the tests can kill -9)."""

from __future__ import annotations

import sys
from pathlib import Path

from mmgrpo_jax.cli import main
from mmgrpo_jax.sweep import runner

FAKE_RUN = str(Path(__file__).with_name("fake_run.py"))


def fake_command_line(config, cell, seed):
    return [sys.executable, FAKE_RUN, *config.run_overrides(cell, seed)]


if __name__ == "__main__":
    runner.command_line = fake_command_line
    sys.exit(main(sys.argv[1:]))
