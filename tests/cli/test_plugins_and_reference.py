"""A task of one's own named on the command line ($MMGRPO_PLUGINS), and the CLI reference the
documentation is built with: every command, option and key, read from the code."""

import json
import sys

import pytest

from mmgrpo_jax import cli
from mmgrpo_jax.cli.reference import cli_reference
from mmgrpo_jax.config_files import config_keys
from programs.tasks import TASKS

TASK_FILE = """
from mmgrpo_jax.program import Example, Predict
from programs.data import Splits
from programs.tasks import register_task

rows = [Example(text=f"word{i}", label=f"word{i}").with_inputs("text") for i in range(6)]
register_task(
    "echo_plugin",
    load=lambda cfg: Splits(rows[:4], rows[4:5], rows[5:]),
    build=lambda cfg, lm: (Predict("text -> label", bare=True), lambda e, p: p.label == e.label),
)
"""


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    (tmp_path / "echo_plugin_task.py").write_text(TASK_FILE)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    TASKS.pop("echo_plugin", None)
    sys.modules.pop("echo_plugin_task", None)


def test_a_task_file_named_in_mmgrpo_plugins_runs_under_its_name(plugin_dir, monkeypatch, capsys):
    monkeypatch.setenv("MMGRPO_PLUGINS", "echo_plugin_task")
    code = cli.main(["optimize-prompts", "--dry-run", "task.name=echo_plugin"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out[out.rindex("{") :]) == {"dry_run": True}


def test_an_unknown_task_or_plugin_is_one_line(plugin_dir, monkeypatch, capsys):
    code = cli.main(["optimize-prompts", "--dry-run", "task.name=echo_plugin"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "'echo_plugin'" in err
    monkeypatch.setenv("MMGRPO_PLUGINS", "echo_plugin_task, no_such_module")
    code = cli.main(["optimize-prompts", "--dry-run", "task.name=echo_plugin"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("mmgrpo optimize-prompts: MMGRPO_PLUGINS=") and "'no_such_module'" in err


def test_a_plugin_that_raises_on_import_is_one_line_exit_2_naming_it(
    plugin_dir, monkeypatch, capsys
):
    """It was a traceback and exit 1, which means "a sweep with failed runs"."""
    (plugin_dir / "broken_plugin.py").write_text("raise KeyError('TASK_TABLE')\n")
    monkeypatch.setenv("MMGRPO_PLUGINS", "broken_plugin")
    code = cli.main(["optimize-prompts", "--dry-run", "task.name=echo_plugin"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "module 'broken_plugin' cannot be imported (KeyError: 'TASK_TABLE')" in err
    sys.modules.pop("broken_plugin", None)


def test_the_cli_reference_lists_every_command_option_and_key():
    text = cli_reference()
    for command in ("demo", "groups", "train", "optimize-prompts", "better-together", "eval"):
        assert f"## `mmgrpo {command}`" in text
        for key, _ in config_keys(cli.command_config_class(command)):
            assert f"| `{key}` |" in text, (command, key)
    for heading in ("## `mmgrpo plan`", "## `mmgrpo sweep`", "### `mmgrpo models fetch`"):
        assert heading in text
    for option in ("--report-only", "--device-memory-gb", "--cache-dir", "--dry-run", "--arch"):
        assert option in text
    assert "| `num_rollouts` | `8` |" in text  # the demo's G, as `mmgrpo demo --help` says
    assert "| `mmgrpo.loss.beta` | `0.0` |" in text


def test_a_keys_note_is_its_fields_help_metadata():
    from mmgrpo_jax.config_files import field_notes
    from tests.cli.noted_config import Noted

    assert field_notes(Noted) == {
        "plain": "what plain is for",
        "made": "made fresh for each config",
        "spelled": "TRL's own spelling",
    }
    assert Noted() == Noted(plain=1, made=(), spelled="x", bare=0.5)
    assert "| `mmgrpo.loss.beta` | `0.0` | the k3 KL to the base weights" in cli_reference()
