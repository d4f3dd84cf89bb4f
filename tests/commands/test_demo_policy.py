"""What the demo's policy reads, and the policy fields a resumed run must keep."""

import json
import logging

import pytest

from mmgrpo_jax import cli
from mmgrpo_jax.commands import demo
from mmgrpo_jax.commands.demo import DemoConfig, record_policy, record_settings, tiny_policy
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program import adapter
from models.tokenizer import chat_prompt_ids
from programs import testbeds


def door_prompt(config: DemoConfig) -> list[str]:
    _, tokenizer = tiny_policy(config)
    door = testbeds.testbed(config.testbed).program().door
    messages = adapter.render(door.signature, {"clue": "amber"}, bare=True)
    return tokenizer.convert_ids_to_tokens(chat_prompt_ids(tokenizer, messages))


def test_the_demo_policy_reads_known_words_only_unless_told_otherwise():
    small = {"hidden_size": 8, "num_layers": 1}
    assert door_prompt(DemoConfig(**small)) == [
        "<|im_start|>",
        "left",
        "right",
        "<|im_end|>",
        "<|im_start|>",
        "amber",
        "<|im_end|>",
        "<|im_start|>",
    ]
    assert door_prompt(DemoConfig(unknown_words="unk", **small)).count("[UNK]") > 50


def test_a_resume_with_another_policy_is_refused_naming_the_field(tmp_path, caplog):
    record_policy(DemoConfig(run_dir=str(tmp_path)), tmp_path)
    assert json.loads((tmp_path / "policy.json").read_text())["unknown_words"] == "drop"
    record_policy(DemoConfig(run_dir=str(tmp_path), resume=True), tmp_path)  # the same: kept
    other = DemoConfig(run_dir=str(tmp_path), resume=True, unknown_words="unk", hidden_size=16)
    with pytest.raises(UserError, match=r"another policy \(.*hidden_size: 32 -> 16"):
        record_policy(other, tmp_path)
    older = tmp_path / "older"
    (older / "checkpoints").mkdir(parents=True)  # a run from before policy.json
    with caplog.at_level(logging.WARNING):
        record_policy(DemoConfig(run_dir=str(older), resume=True), older)
    assert "has no policy.json" in caplog.text and (older / "policy.json").is_file()


def test_a_policy_json_that_is_not_json_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "policy.json").write_text('{"testbed": "doors", "hidden')
    argv = ["demo", f"run_dir={tmp_path}", "resume=true", "progress=false"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0]
    assert f"{tmp_path / 'policy.json'} cannot be read (JSONDecodeError" in err[0]
    assert "restore it or choose another run_dir" in err[0]


def test_resume_continues_the_run_with_the_settings_it_was_started_with(
    tmp_path, monkeypatch, caplog
):
    """`demo run_dir=... resume=true` resumes a counter run of 6 steps as one (it needed
    testbed=counter again and quietly became 150 steps); what the user gives still wins."""
    started = DemoConfig(testbed="counter", num_steps=6, examples_per_step=2, run_dir=str(tmp_path))
    record_settings(started, tmp_path)
    seen = []
    monkeypatch.setattr(demo, "main", lambda config, out: seen.append(config) or 0)
    with caplog.at_level(logging.WARNING):
        assert cli.main(["demo", f"run_dir={tmp_path}", "resume=true"]) == 0
    assert (seen[0].testbed, seen[0].num_steps, seen[0].examples_per_step) == ("counter", 6, 2)
    assert seen[0].resume and seen[0].run_dir == str(tmp_path)
    assert "with the settings it was started with (testbed=counter" in caplog.text
    assert cli.main(["demo", f"run_dir={tmp_path}", "resume=true", "num_steps=10"]) == 0
    assert (seen[1].testbed, seen[1].num_steps) == ("counter", 10)
    assert cli.main(["demo", f"run_dir={tmp_path / 'fresh'}", "num_steps=3"]) == 0
    assert (seen[2].testbed, seen[2].num_steps) == ("two_doors", 3)  # no resume: no record read
