import subprocess
import sys
from pathlib import Path

import pytest

from experiments.grouping_ablation import Run, table

ROOT = Path(__file__).parents[2]


def run(grouping, loss, seed, rewards):
    return Run(grouping, loss, seed, [0, 10, 20][: len(rewards)], rewards, 1.0)


def test_table_reports_mean_std_and_steps_to_target():
    runs = [
        run("module", "grpo", 0, [0.0, 0.75, 1.0]),
        run("module", "grpo", 1, [0.0, 0.25, 0.5]),
        run("trajectory", "grpo", 0, [0.25, 0.5, 0.7]),
    ]
    lines = table(runs, ["module", "trajectory"], ["grpo"]).splitlines()
    assert lines[2] == "| module | grpo | 0.75 ± 0.25 | 10, never | 2 |"
    assert lines[3] == "| trajectory | grpo | 0.70 ± 0.00 | 20 | 1 |"


@pytest.mark.slow
def test_script_writes_table_csv_and_plot(tmp_path):
    command = [sys.executable, "experiments/grouping_ablation.py", "--seeds", "0", "--steps", "2"]
    command += ["--losses", "grpo", "cispo", "--out", str(tmp_path)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=900)
    assert (tmp_path / "grouping_ablation.md").read_text().count("| module |") == 2
    assert len((tmp_path / "grouping_ablation.csv").read_text().splitlines()) == 5
    assert (tmp_path / "grouping_ablation.png").stat().st_size > 1000
