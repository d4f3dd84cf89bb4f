"""The demo's Table 1 methods: each is scored like the demo, into the same summary.json."""

import dataclasses
import json

import pytest

from mmgrpo_jax.commands.demo import DemoConfig, run_demo
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.trainer.mmgrpo import evaluate


def test_an_unknown_method_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"DemoConfig.method must be one of .* got 'mipro'"):
        DemoConfig(method="mipro")
    with pytest.raises(ValueError, match="prompt_candidates must be >= 2, got 1"):
        DemoConfig(method="prompt_opt", prompt_candidates=1)
    with pytest.raises(ValueError, match=r"DemoConfig.unknown_words must be one of .* got 'unkn'"):
        DemoConfig(unknown_words="unkn")


def test_vanilla_scores_the_program_as_written_once(tmp_path):
    config = DemoConfig(method="vanilla", run_dir=str(tmp_path), progress=False)
    summary = run_demo(config)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["method"] == "vanilla" and written["wall_seconds"] > 0
    assert written["eval_reward_after"] == written["eval_reward_before"]
    assert summary == {**written, "run_dir": str(tmp_path)}
    with pytest.raises(UserError, match="already holds a finished run"):
        run_demo(config)
    kept = run_demo(dataclasses.replace(config, resume=True))  # returned, not redone
    assert kept == summary and json.loads((tmp_path / "summary.json").read_text()) == written
    other = dataclasses.replace(config, resume=True, method="prompt_opt")
    with pytest.raises(UserError, match=r"other settings \(method: 'vanilla' -> 'prompt_opt'"):
        run_demo(other)


def test_better_together_trains_in_weights_and_returns_its_best_stage(tmp_path, monkeypatch):
    scores = []

    def recording_evaluate(*args, **kwargs):
        scores.append(evaluate(*args, **kwargs))
        return scores[-1]

    monkeypatch.setattr("mmgrpo_jax.commands.demo.evaluate", recording_evaluate)
    config = DemoConfig(
        method="better_together",
        num_steps=2,
        prompt_candidates=2,
        run_dir=str(tmp_path),
        progress=False,
    )
    summary = run_demo(config)
    assert set(summary["stages"]) == {"start", "p", "w"}
    assert summary["eval_reward_before"] == summary["stages"]["start"]
    # BetterTogether keeps its best stage; scoring the program it returned says the same
    assert summary["eval_reward_after"] == max(summary["stages"].values())
    assert scores[-1] == summary["eval_reward_after"]
    weights = json.loads((tmp_path / "weights" / "summary.json").read_text())
    assert weights["steps"] == 2 and weights["eval_reward_after"] == summary["stages"]["w"]
    assert json.loads((tmp_path / "summary.json").read_text())["method"] == "better_together"
