"""The command line's contract: user errors are one line and exit 2 before any model is built;
SIGINT / SIGTERM exit 130 / 143 with the checkpoint written; overrides go anywhere."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from mmgrpo_jax import cli
from mmgrpo_jax.commands import demo, experiment
from mmgrpo_jax.config_files import load_config
from mmgrpo_jax.trainer.config import MMGRPOConfig
from mmgrpo_jax.trainer.run_lock import RunLock
from tests.paper_data import skip_without_paper_data
from tests.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    skip_without_paper_data()  # its tokenizer is trained on the paper tasks' text
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a command gets as far as building or loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the user error was reported")

    monkeypatch.setattr(demo, "tiny_policy", refuse)
    monkeypatch.setattr(experiment, "load_policy", refuse)
    monkeypatch.setattr(experiment, "load_eval_policy", refuse)


def one_line_error(capsys):
    """The command's whole stderr: one line, no traceback, no usage block."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("num_rollouts=1", "num_rollouts must be >= 2"),
        ("lr=0", "OptimConfig.lr must be > 0, got 0"),
        ("loss=foo", "LossConfig.variant must be a registered loss"),
        ("beta=-1.0", "LossConfig.beta must be >= 0, got -1.0"),
        ("hidden_size=2", "hidden_size=2 is not a multiple of num_heads=4"),
        ("seed=-1", "MMGRPOConfig.seed must be in [0, 2**32) (it seeds the sampling keys), got -1"),
        ("examples_per_step=100", "examples_per_step must be <= 16"),
        ("resume=true", "resume=true needs the run_dir"),
        ("checkpoint_every=0", "checkpoint_every must be >= 1, got 0"),
    ],
)
def test_demo_values_are_refused_in_one_line_before_the_model_is_built(
    capsys, no_model, override, message
):
    assert cli.main(["demo", override]) == 2
    assert message in one_line_error(capsys)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1", "coordinator_address must be host:port, e.g. 10.0.0.1:1234, got '127.0.0.1'"),
        ("127.0.0.1:99999", "must have a port in 1-65535, got '127.0.0.1:99999'"),
    ],
)
def test_a_malformed_coordinator_address_is_one_line_before_any_process_joins(
    tmp_path, capsys, no_model, monkeypatch, address, message
):
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: pytest.fail("joined"))
    argv = [
        "demo",
        f"run_dir={tmp_path / 'run'}",
        "distributed.num_processes=2",
        f"distributed.coordinator_address={address}",
    ]
    assert cli.main(argv) == 2
    assert message in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_overrides_go_before_between_and_after_options_and_read_1e_5_as_a_number(
    tmp_path, monkeypatch
):
    seen = {}
    monkeypatch.setattr(demo, "main", lambda config, out: seen.setdefault("config", config) and 0)
    argv = ["demo", "lr=1e-5", "--grouping", "trajectory", "num_steps=3", "--config"]
    (tmp_path / "demo.yaml").write_text("seed: 4\nbeta: 2e-2\n")
    assert cli.main([*argv, str(tmp_path / "demo.yaml"), "num_rollouts=4"]) == 0
    got = seen["config"]
    assert (got.lr, got.grouping, got.num_steps, got.num_rollouts) == (1e-5, "trajectory", 3, 4)
    assert (got.seed, got.beta) == (4, 0.02)


def test_yaml_numbers_as_users_write_them(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim: {lr: 1e-5, weight_decay: 1E-2}\nloss: {epsilon: 2e-1}\n")
    cfg = load_config(MMGRPOConfig, path, ["failure_score=-5e-1"])
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.loss.epsilon) == (1e-5, 0.01, 0.2)
    assert cfg.failure_score == -0.5


def test_invalid_yaml_is_one_line_naming_the_file_and_place(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("num_steps: 3\nloss: {variant: dapo\n")
    assert cli.main(["demo", "--config", str(path)]) == 2
    line = one_line_error(capsys)
    assert "bad.yaml' is not valid YAML" in line and "line 3" in line


def test_a_run_dir_in_use_is_refused_in_one_line(tmp_path, capsys, no_model):
    with RunLock(tmp_path / "run"):
        assert cli.main(["demo", f"run_dir={tmp_path / 'run'}", "progress=false"]) == 2
    assert f"is in use by another run (pid {os.getpid()} on" in one_line_error(capsys)


def experiment_config(tmp_path, checkpoint, **mmgrpo_fields):
    fields = {"model_path": str(checkpoint), "run_dir": str(tmp_path / "run"), **mmgrpo_fields}
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps({"task": {"name": "banking77"}, "mmgrpo": fields}))
    return path


def test_train_refuses_a_too_large_step_and_a_used_run_dir_before_loading(
    tmp_path, checkpoint, capsys, no_model
):
    path = experiment_config(tmp_path, checkpoint, examples_per_step=4)
    argv = ["train", "--config", str(path), "train_limit=3"]
    assert cli.main(argv) == 2
    assert "examples_per_step=4 is larger than the trainset of banking77 (3 examples, " in (
        one_line_error(capsys)
    )
    (tmp_path / "run" / "checkpoints" / "5").mkdir(parents=True)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = one_line_error(capsys)
    assert "already holds a run's checkpoints (steps [5])" in err
    # the keys as this command takes them (it said `set resume=true`, a key train refuses)
    assert f"mmgrpo.run_dir={str(tmp_path / 'run')!r}" in err
    assert "set mmgrpo.resume=true to continue" in err


def test_a_stopped_experiment_names_its_resume_key_as_the_command_takes_it(tmp_path, capsys):
    """`mmgrpo better-together` under SIGTERM said "resume=true continues the run", which the
    command refuses (unknown key); its trainer's key is mmgrpo.resume."""
    from mmgrpo_jax.trainer.interrupt import Interrupted

    def stopped(config, **options):
        err = Interrupted(signal.SIGTERM)
        err.add_note(f"the checkpoint of step 12 is in '{tmp_path}'; resume=true continues the run")
        raise err

    commands = {**experiment.COMMANDS, "better-together": stopped}
    config = capitals_config(tmp_path)
    with pytest.raises(Interrupted) as caught, pytest.MonkeyPatch.context() as patch:
        patch.setattr(experiment, "COMMANDS", commands)
        experiment.main("better-together", config, sys.stdout)
    assert caught.value.__notes__ == [
        f"the checkpoint of step 12 is in '{tmp_path}'; mmgrpo.resume=true continues the run"
    ]


def capitals_config(tmp_path):
    from models.tiny_checkpoint import write_tiny_checkpoint as write_random

    checkpoint = write_random(tmp_path / "tiny")
    overrides = [f"mmgrpo.model_path={checkpoint}", "task.name=capitals"]
    return load_config(experiment.ExperimentConfig, None, overrides)


def damage_tokenizer(directory):
    (directory / "tokenizer.json").unlink()


def truncate_weights(directory):
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])


def bad_config_json(directory):
    (directory / "config.json").write_text("{not json")


def unsupported_model_type(directory):
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))


def no_chat_template(directory):
    for path in directory.glob("chat_template*"):
        path.unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (truncate_weights, "model.safetensors' is not a readable safetensors file"),
        (bad_config_json, "config.json' is not valid JSON"),
        (unsupported_model_type, "model_type 'gpt2' is not supported"),
        (no_chat_template, "has no chat_template: use the instruct (chat) checkpoint"),
        (damage_tokenizer, "no tokenizer in"),
    ],
)
def test_a_broken_checkpoint_is_one_line_naming_the_file(
    tmp_path, capsys, checkpoint, damage, message
):
    broken = write_tiny_checkpoint(tmp_path / "broken")
    damage(broken)
    capsys.readouterr()  # the writer's progress bar is not the command's
    argv = ["eval", "--program", "banking77", "--model", str(broken), "--limit", "1"]
    assert cli.main([*argv, f"out={tmp_path / 'p.jsonl'}"]) == 2
    assert message in one_line_error(capsys)


def test_an_unwritable_eval_output_is_refused_before_the_model_loads(
    tmp_path, checkpoint, capsys, no_model
):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["eval", "--program", "banking77", "--model", str(checkpoint)]
    assert cli.main([*argv, "--out", str(blocker / "p.jsonl")]) == 2
    assert "EvalConfig.out=" in one_line_error(capsys)


# ---------------------------------------------------------------- signals, as a user sends them


def start_demo(run_dir, *extra):
    argv = [sys.executable, "-m", "mmgrpo_jax.cli", "demo", f"run_dir={run_dir}"]
    argv += ["num_steps=40", "num_rollouts=4", "examples_per_step=4", "checkpoint_every=100"]
    argv += ["progress=false", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


@pytest.mark.parametrize(
    "signum",
    [
        # SIGTERM through the demo is slow (~70 s); test_run_safety sends it during an update
        pytest.param(signal.SIGTERM, id="SIGTERM", marks=pytest.mark.slow),
        pytest.param(signal.SIGINT, id="SIGINT"),
    ],
)
def test_a_signal_to_the_demo_exits_128_plus_n_with_a_checkpoint_and_resumes(tmp_path, signum):
    run_dir = tmp_path / "demo"
    process = start_demo(run_dir)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.is_file() and sum(1 for _ in metrics.open()) >= 4:
            break
        time.sleep(0.2)
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"mmgrpo demo: stopped by {signal.Signals(signum).name}; ")
    assert "resume=true continues the run" in last
    assert "Traceback" not in err
    [saved] = [p.name for p in (run_dir / "checkpoints").iterdir()]
    logged = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert int(saved) == max(r["step"] for r in logged if "loss" in r)
    if signum == signal.SIGINT:
        return  # resuming is the same for both; once is enough for the suite's time
    resumed = start_demo(run_dir, "resume=true", "num_steps=" + str(int(saved) + 1))
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err
    assert json.loads(out)["steps"] == int(saved) + 1


def test_a_nan_producing_learning_rate_leaves_no_non_finite_value_in_any_checkpoint(tmp_path):
    import numpy as np
    import orbax.checkpoint as ocp

    from mmgrpo_jax.errors import UserError

    config = demo.DemoConfig(
        num_steps=10, lr=1e5, checkpoint_every=1, run_dir=str(tmp_path), progress=False
    )
    with pytest.raises(UserError, match="updates in a row had a non-finite"):
        demo.run_demo(config)
    manager = ocp.CheckpointManager(tmp_path / "checkpoints")
    assert manager.all_steps()
    for step in manager.all_steps():
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        for leaf in jax.tree.leaves(state.state):
            assert np.all(np.isfinite(np.asarray(leaf, np.float64))), step
    manager.close()


def test_demo_run_dirs_are_unique_within_a_second(tmp_path):
    made = {demo.new_run_dir(tmp_path) for _ in range(20)}
    assert len(made) == 20 and all(p.is_dir() for p in made)


def test_a_second_demo_into_a_running_demos_run_dir_is_refused_and_the_first_finishes(
    tmp_path, capsys
):
    run_dir = tmp_path / "demo"
    first = start_demo(run_dir, "num_steps=6")
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").is_file() and time.monotonic() < deadline:  # training
        time.sleep(0.1)
    assert cli.main(["demo", f"run_dir={run_dir}", "seed=1", "progress=false"]) == 2
    assert f"in use by another run (pid {first.pid} on" in one_line_error(capsys)
    out, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    meta = json.loads((run_dir / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["config"]["seed"] == 0 and json.loads(out)["steps"] == 6


def test_an_adapter_of_another_model_is_one_line_naming_its_base_and_the_model(tmp_path, capsys):
    """An adapter trained on one checkpoint, evaluated on another shape: it was a traceback on a
    shape mismatch; now the adapter names its base (PEFT's base_model_name_or_path) and the
    command names both."""
    from models.export import save_peft_adapter
    from models.hf import load_checkpoint
    from models.lora import LoRAConfig
    from models.tiny_checkpoint import write_tiny_checkpoint as write_random

    trained_on = write_random(tmp_path / "narrow", hidden_size=32)
    other = write_random(tmp_path / "wide", hidden_size=64)
    model, _, _ = load_checkpoint(trained_on, lora=LoRAConfig(rank=2, alpha=4.0))
    adapter = save_peft_adapter(model, tmp_path / "adapter", base_model=str(trained_on))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(trained_on)
    capsys.readouterr()
    argv = ["eval", "--program", "capitals", "--model", str(other), "--adapter", str(adapter)]
    assert cli.main([*argv, "--limit", "1", "--out", str(tmp_path / "p.jsonl")]) == 2
    err = one_line_error(capsys)
    assert f"was trained on {str(trained_on)!r}, not on the model {str(other)!r}" in err
    assert "has shape" in err and "load it into the model it was trained on" in err
    argv = ["eval", "--program", "capitals", "--model", str(trained_on), "--adapter", str(adapter)]
    assert cli.main([*argv, "--limit", "1", "--out", str(tmp_path / "p.jsonl")]) == 0


@pytest.mark.parametrize("argv", [["train", "--help"], ["models", "list"]], ids=" ".join)
def test_a_reader_that_goes_away_ends_the_command_quietly(argv):
    """`mmgrpo train --help | head -1` was a BrokenPipeError traceback: with stdout's reader
    gone before the first write, the command exits 141 (as if killed by SIGPIPE), saying nothing."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[2])}
    command = [sys.executable, "-m", "mmgrpo_jax.cli", *argv]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    child.stdout.close()  # the reader is gone before anything is written
    _, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGPIPE and err.decode() == ""


BT_TASK = """
from mmgrpo_jax.program import Predict
from programs import capitals
from programs.tasks import register_task

register_task(  # a reward the tiny random policy gets half the time: groups with a spread
    "bt_parity",
    load=lambda cfg: capitals.load_capitals(cfg.split_seed),
    build=lambda cfg, lm: (
        Predict("question -> answer", bare=True), lambda e, p: float(len(p.answer) % 2)
    ),
)
"""


@pytest.mark.slow
def test_better_together_stopped_or_killed_in_its_weight_stage_resumes_to_the_same_run(tmp_path):
    """SIGTERM (exit 143, the checkpoint written, the note naming `mmgrpo.resume=true`) and
    kill -9 (exit 137, the last periodic checkpoint) in the weight stage; started again with
    mmgrpo.resume=true, the prompt stage is redone and the weight stage continues: the same
    stages' scores, losses and best adapter as a run never stopped. (~6 min)"""
    from models.tiny_checkpoint import write_tiny_checkpoint as write_random

    (tmp_path / "bt_parity_task.py").write_text(BT_TASK)
    checkpoint = write_random(tmp_path / "tiny")
    config = tmp_path / "bt.yaml"
    config.write_text(json.dumps({
        "task": {"name": "bt_parity"},
        "mmgrpo": {
            "model_path": str(checkpoint), "num_rollouts": 2, "examples_per_step": 2,
            "num_steps": 8, "eval_every": 100, "checkpoint_every": 4, "progress": False,
            "sampler": {"max_prompt_tokens": 256, "max_completion_tokens": 4},
        },
        "prompt_opt": {"num_candidates": 2, "num_trials": 2, "minibatch_size": 2},
        "train_limit": 4, "val_limit": 2, "test_limit": 2,
    }))  # fmt: skip
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "MMGRPO_PLUGINS": "bt_parity_task",
    }
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(
        "--xla_force_host_platform_device_count=8", ""
    )

    def start(name, *extra):  # stderr to a file: a full pipe would stall the run
        argv = [sys.executable, "-m", "mmgrpo_jax.cli", "better-together", "--config", str(config)]
        argv += [f"mmgrpo.run_dir={tmp_path / name}", *extra]
        with (tmp_path / f"{name}.log").open("a") as log:
            return subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=log)

    def finished(name, *extra):
        child = start(name, *extra)
        assert child.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        run = tmp_path / name
        losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").open()) if "loss" in r]
        stages = json.loads((run / "summary.json").read_text())["stages"]
        adapter = (run / "best" / "adapter" / "adapter_model.safetensors").read_bytes()
        return losses, stages, adapter

    def stop_at(name, step, signum):
        child, metrics = start(name), tmp_path / name / "metrics.jsonl"
        deadline = time.monotonic() + 600
        while f'"step": {step}.0' not in (metrics.read_text() if metrics.is_file() else ""):
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        child.send_signal(signum)
        return child.wait(timeout=300), (tmp_path / f"{name}.log").read_text()

    clean = finished("clean")
    code, err = stop_at("stopped", 5, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1].endswith("; mmgrpo.resume=true continues the run")
    assert finished("stopped", "mmgrpo.resume=true") == clean
    code, _ = stop_at("killed", 6, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert finished("killed", "mmgrpo.resume=true") == clean


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"other": {"instructions": "x", "demos": []}}',
            "missing ['capital', 'country'], unknown",
        ),
        ("{broken", "Expecting property name enclosed in double quotes"),
    ],
    ids=["another_programs", "not_json"],
)
@pytest.mark.parametrize(
    ("command", "field"), [("train", "prompt_state"), ("better-together", "prompt_stage")]
)
def test_a_prompt_state_that_cannot_load_is_one_line_before_the_model(
    tmp_path, capsys, no_model, text, message, command, field
):
    """Both were tracebacks (exit 1) after the model had loaded."""
    from models.tiny_checkpoint import write_tiny_checkpoint as write_random

    state = tmp_path / "prompt_state.json"
    state.write_text(text)
    checkpoint = write_random(tmp_path / "tiny")
    argv = [command, "task.name=capitals", f"mmgrpo.model_path={checkpoint}"]
    argv += [f"mmgrpo.run_dir={tmp_path / 'run'}", f"{field}={state}"]
    assert cli.main(argv) == 2
    err = one_line_error(capsys)
    assert f"ExperimentConfig.{field}={str(state)!r} cannot be loaded into the program" in err
    assert message in err


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("w", "stands for a strategy's one prompt stage, first; strategy='w'"),
        ("w -> p", "stands for a strategy's one prompt stage, first; strategy='w -> p'"),
        ("p -> w -> p", "one prompt stage, first; strategy='p -> w -> p'"),
        ("p -> w", "is not a file"),
    ],
)
def test_a_loaded_prompt_stage_must_be_the_strategys_first_and_a_file(
    tmp_path, capsys, no_model, strategy, message
):
    """The search it stands for ran on the base weights, before any other stage."""
    from models.tiny_checkpoint import write_tiny_checkpoint as write_random

    state = tmp_path / ("prompt_state.json" if strategy != "p -> w" else "absent.json")
    if strategy != "p -> w":
        state.write_text("{}")
    checkpoint = write_random(tmp_path / "tiny")
    argv = ["better-together", "task.name=capitals", f"mmgrpo.model_path={checkpoint}"]
    argv += [f"strategy={strategy}", f"prompt_stage={state}"]
    assert cli.main(argv) == 2
    err = one_line_error(capsys)
    assert f"ExperimentConfig.prompt_stage={str(state)!r}" in err and message in err
