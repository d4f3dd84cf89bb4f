"""The `mmgrpo eval` commands docs/real-lm.md gives for the paper's program shapes run as written
(on the first two test examples), with the fetched SmolLM2-135M: what a fresh clone types."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from mmgrpo_jax.cli import main
from models.fetch import fetched
from programs import registry_data
from tests.paper_data import LOCAL_DATA

PAGE = Path(__file__).resolve().parents[2] / "docs" / "real-lm.md"
PROGRAMS = ("banking77_shortlist", "papillon_lexical", "fanoutqa")


def documented_eval(program: str) -> list[str]:
    """The page's one `mmgrpo eval --program <program> ...` command, its argv after `mmgrpo`."""
    text = " ".join(PAGE.read_text().split())  # the commands wrap across lines
    found = re.findall(rf"`mmgrpo (eval --program {program} [^`]*)`", text)
    assert len(found) == 1, f"docs/real-lm.md gives {len(found)} eval commands for {program}"
    return shlex.split(found[0])


@pytest.mark.slow
@pytest.mark.skipif(fetched("smollm2-135m") is None, reason="run `make model` (make test does)")
@pytest.mark.parametrize("program", PROGRAMS)
def test_the_documented_eval_command_runs_on_the_test_split(program, tmp_path, capsys):
    if program != "fanoutqa" and LOCAL_DATA is None:
        pytest.skip("needs the paper's datasets ($MMGRPO_DATA_DIR; the hub is off in tests)")
    if program == "fanoutqa" and (
        registry_data.damaged("fanoutqa") or registry_data.damaged("vital_articles")
    ):
        pytest.skip("run `make data` (make test does)")
    argv = documented_eval(program)
    assert argv[argv.index("--split") + 1] == "test" and "--model" in argv
    out = tmp_path / "predictions.jsonl"
    assert main([*argv, "--limit", "2", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f'"task": "{program}"' in said and '"examples": 2' in said
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    assert all(0.0 <= r["score"] <= 1.0 for r in rows)
