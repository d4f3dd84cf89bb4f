import subprocess
import sys
from pathlib import Path

import pytest

from experiments.table1 import Result, scripted_prompt_model, table
from mmgrpo_jax.program.adapter import parse
from mmgrpo_jax.prompt_opt.proposer import PROPOSE
from programs import synthetic

ROOT = Path(__file__).parents[2]


def test_table_reports_mean_std_and_every_seed_in_method_order():
    results = [
        Result("mmgrpo", 0, 1.0, 1.0),
        Result("vanilla", 0, 0.0, 1.0),
        Result("mmgrpo", 1, 0.5, 1.0),
    ]
    lines = table(results).splitlines()
    assert lines[2] == "| Vanilla | 0.00 ± 0.00 | 0.00 (seed 0) |"
    assert lines[3] == "| mmGRPO | 0.75 ± 0.25 | 1.00 (seed 0), 0.50 (seed 1) |"
    assert len(lines) == 4  # methods without results are left out


def test_scripted_prompt_model_writes_task_words_seeded_by_its_prompt():
    lm = scripted_prompt_model(seed=0)

    def propose(text):
        reply = lm([{"role": "user", "content": text}]).text
        return parse(PROPOSE, reply)["proposed_instruction"]

    words = propose("tip: be creative").split()
    assert 3 <= len(words) <= 8 and set(words) <= {*synthetic.SIGN_WORDS, *synthetic.DOORS}
    assert propose("tip: be creative") == " ".join(words)
    assert propose("tip: keep it simple") != " ".join(words)


@pytest.mark.slow
def test_script_writes_table_csv_and_plot(tmp_path):
    command = [sys.executable, "experiments/table1.py", "--seeds", "0", "--steps", "2"]
    command += ["--candidates", "3", "--warmup-steps", "1", "--out", str(tmp_path)]
    subprocess.run(command, cwd=ROOT, check=True, timeout=900)
    assert (tmp_path / "table1.md").read_text().count(" (seed 0) |") == 4
    assert len((tmp_path / "table1.csv").read_text().splitlines()) == 5
    assert (tmp_path / "table1.png").stat().st_size > 1000
