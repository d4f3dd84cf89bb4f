"""Run safety: signals stop at a safe point with a good checkpoint, non-finite updates never land,
one run per run_dir, damaged checkpoints fall back, resumes report the truth."""

import json
import logging
import os
import shutil
import signal
import struct
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmgrpo_jax
from mmgrpo_jax import LossConfig, TokenTerms
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program import Example
from mmgrpo_jax.rl.losses import VARIANTS
from mmgrpo_jax.rl.rollout import run_rollouts
from mmgrpo_jax.testing import ScriptedLM, tiny_decoder
from mmgrpo_jax.trainer.checkpoint import array_records
from mmgrpo_jax.trainer.interrupt import Interrupted
from mmgrpo_jax.trainer.learner import Guard
from mmgrpo_jax.trainer.mmgrpo import MMGRPO
from mmgrpo_jax.trainer.run_lock import RunLock
from models.lora import LoRAConfig
from tests.rl.test_rollout import EXAMPLE, GOOD, TwoStep, exact
from tests.trainer.test_mmgrpo import (
    TRAIN,
    VAL,
    RaiseAtCall,
    TwoModules,
    config,
    new_model,
    reward,
    run,
)


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params(model):
    return jax.tree.map(np.asarray, nnx.state(model, nnx.Param))


def assert_same(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


class SignalDuringUpdate(MMGRPO):
    """Sends `signum` to this process while the update of step `at_step` (1-based) runs."""

    def __init__(self, *args, signum, at_step, **kwargs):
        super().__init__(*args, **kwargs)
        self.signum, self.at_step = signum, at_step

    def _update(self, learner, batch, guard, step, *rest):
        if step + 1 == self.at_step:
            os.kill(os.getpid(), self.signum)  # delivered right away, inside the update
        return super()._update(learner, batch, guard, step, *rest)


def run_with(cls, tokenizer, cfg, model=None, metric=reward, **kwargs):
    model = model or new_model(tokenizer)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    optimizer = cls(metric, cfg, model=model, tokenizer=tokenizer, stop_token_ids=stop, **kwargs)
    optimizer.compile(TwoModules(), TRAIN, VAL if cfg.eval_every < 100 else ())
    return model, optimizer


# ---------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_the_update_checkpoints_that_step_and_resumes_bit_identical(
    tokenizer, tmp_path, signum
):
    steps = dict(num_steps=4, checkpoint_every=10, eval_every=100)
    straight, _ = run(tokenizer, config(tmp_path / "a", **steps))
    cfg = config(tmp_path / "b", **steps)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(Interrupted) as caught:
        run_with(SignalDuringUpdate, tokenizer, cfg, signum=signum, at_step=2)
    assert caught.value.exit_code == 128 + signum
    run_dir = tmp_path / "b" / "run"
    # the update that was running completed and is in the checkpoint: step 2, not 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]
    assert [r["step"] for r in rows(run_dir) if "loss" in r] == [1.0, 2.0]
    assert not (run_dir / "run.lock").exists()
    resumed, _ = run(tokenizer, config(tmp_path / "b", resume=True, **steps))
    assert_same(params(straight), params(resumed))
    assert [r["step"] for r in rows(run_dir) if "loss" in r] == [1.0, 2.0, 3.0, 4.0]
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # the run's handlers are gone


# ---------------------------------------------------------------- non-finite updates


@pytest.fixture
def nan_loss():
    def token_terms(cfg, x):
        loss = -x.advantages * x.logps * jnp.nan
        none = jnp.zeros_like(x.mask)
        return TokenTerms(loss, jnp.ones_like(x.logps), none, none)

    mmgrpo_jax.register_loss("always_nan", token_terms, aggregation="token_mean_global")
    yield "always_nan"
    VARIANTS.pop("always_nan")


def test_non_finite_updates_are_skipped_and_stop_the_run_with_finite_checkpoints(
    tokenizer, tmp_path, nan_loss
):
    model = new_model(tokenizer)
    before = params(model)
    cfg = config(tmp_path, num_steps=6, eval_every=100, loss=LossConfig(nan_loss))
    with pytest.raises(UserError, match=r"step 3: 3 updates in a row had a non-finite loss"):
        run(tokenizer, cfg, model)
    run_dir = tmp_path / "run"
    logged = rows(run_dir)
    assert [r["skipped_updates"] for r in logged if "loss" in r] == [1.0, 1.0]
    assert_same(before, params(model))  # nothing non-finite was ever applied
    again = config(tmp_path, num_steps=2, eval_every=100, resume=True, loss=LossConfig(nan_loss))
    resumed, _ = run(tokenizer, again)
    assert_same(before, params(resumed))  # the checkpoint (step 2) holds the finite start


def test_a_non_finite_array_is_never_checkpointed():
    with pytest.raises(ValueError, match=r"non-finite array: state\['w'\]"):
        array_records({"state": {"w": jnp.array([1.0, jnp.inf]), "n": jnp.array([1])}})
    records = array_records({"state": {"w": jnp.ones(3, jnp.bfloat16)}})
    assert list(records) == ["state['w']"]
    assert records["state['w']"]["shape"] == [3] and records["state['w']"]["dtype"] == "bfloat16"


# ---------------------------------------------------------------- one run per run_dir


def test_a_second_run_is_refused_while_another_holds_the_run_dir(tokenizer, tmp_path):
    cfg = config(tmp_path, num_steps=1, eval_every=100)
    holder = rf"in use by another run \(pid {os.getpid()} on"
    with RunLock(tmp_path / "run"), pytest.raises(UserError, match=holder):
        run(tokenizer, cfg)
    run(tokenizer, cfg)  # released: the run goes ahead
    assert not (tmp_path / "run" / "run.lock").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 99999999, "host": "h", "since": 0}))
    with caplog.at_level(logging.WARNING), RunLock(tmp_path):
        held = json.loads((tmp_path / "run.lock").read_text())
    assert held["pid"] == os.getpid()
    assert "did not exit cleanly (pid 99999999 on h" in caplog.text


# ---------------------------------------------------------------- damaged checkpoints


class Crash(BaseException):
    """Stands in for kill -9: no handler runs, nothing is saved on the way out."""


def largest_data_file(step_dir):
    """The biggest array-data file of a checkpoint's train state: the one restore reads (OCDBT
    keeps the merged data in state/d/, next to the per-process copies it was merged from)."""
    files = [p for p in (step_dir / "state" / "d").iterdir() if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def wrong_checksum(path):
    """Data that reads back fine but differs from what was saved (the checksum path)."""
    meta = path.parents[2] / "meta" / "metadata"
    saved = json.loads(meta.read_text())
    key = sorted(saved["arrays"])[0]
    saved["arrays"][key]["crc32"] = "00000000"
    meta.write_text(json.dumps(saved))


DAMAGE_STEPS = dict(num_steps=3, checkpoint_every=1, eval_every=100)


@pytest.fixture(scope="module")
def crashed_in_step_3(tokenizer, tmp_path_factory):
    """An uninterrupted run's weights, and a run dir that crashed in step 3 (checkpoints 1, 2)."""
    root = tmp_path_factory.mktemp("crashed")
    straight, _ = run(tokenizer, config(root / "a", **DAMAGE_STEPS))
    with pytest.raises(Crash):  # metric calls: 2 (eval) + 6 + 6, then step 3's
        run(tokenizer, config(root / "b", **DAMAGE_STEPS), metric=RaiseAtCall(16, Crash))
    return params(straight), root / "b" / "run"


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(truncate, id="truncated"),
        # ~30 s each; the same fallback as the truncated and checksum cases: make test-slow
        pytest.param(flip, id="flipped", marks=pytest.mark.slow),
        pytest.param(os.remove, id="deleted", marks=pytest.mark.slow),
        pytest.param(wrong_checksum, id="checksum"),
    ],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    tokenizer, tmp_path, caplog, damage, crashed_in_step_3
):
    straight, crashed = crashed_in_step_3
    shutil.copytree(crashed, tmp_path / "b" / "run")
    ckpts = tmp_path / "b" / "run" / "checkpoints"
    steps = DAMAGE_STEPS
    damage(largest_data_file(ckpts / "2"))
    with caplog.at_level(logging.WARNING):
        resumed, _ = run(tokenizer, config(tmp_path / "b", resume=True, **steps))
    assert "the checkpoint of step 2 is damaged" in caplog.text
    assert "resuming from the intact checkpoint of step 1" in caplog.text
    assert_same(straight, params(resumed))  # steps 2 and 3 replayed from step 1
    # the damaged step was set aside and written afresh by the resumed run
    assert sorted(p.name for p in ckpts.iterdir()) == ["2", "3"]
    [aside] = (ckpts.parent / "damaged-checkpoints").iterdir()
    assert aside.name.startswith("2-")
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the next resume finds nothing damaged
        run(tokenizer, config(tmp_path / "b", resume=True, **{**steps, "num_steps": 4}))
    assert "damaged" not in caplog.text


def test_a_checkpoint_of_another_model_is_refused_not_taken_for_damaged(tokenizer, tmp_path):
    run(tokenizer, config(tmp_path, num_steps=1, eval_every=100))
    wider = tiny_decoder(len(tokenizer), hidden_size=64, lora=LoRAConfig(rank=2, alpha=4.0))
    cfg = config(tmp_path, num_steps=2, eval_every=100, resume=True)
    with pytest.raises(UserError, match=r"does not fit this run's model and optimizer \(\d+ "):
        run(tokenizer, cfg, model=wider)


def test_no_intact_checkpoint_is_one_clear_error(tokenizer, tmp_path):
    run(tokenizer, config(tmp_path, num_steps=2, checkpoint_every=1, eval_every=100))
    for step in ("1", "2"):
        truncate(largest_data_file(tmp_path / "run" / "checkpoints" / step))
    with pytest.raises(UserError, match=r"no intact checkpoint in .*step 2: .*; step 1: "):
        run(tokenizer, config(tmp_path, num_steps=3, eval_every=100, resume=True))


def test_leftovers_of_an_unfinished_write_block_nothing(tokenizer, tmp_path):
    leftover = tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
    (leftover / "state").mkdir(parents=True)
    run(tokenizer, config(tmp_path, num_steps=1, eval_every=100))  # a fresh run is not refused
    assert not leftover.exists()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["1"]


# ---------------------------------------------------------------- resume reports the truth


def tensorboard_purges(run_dir):
    """The steps of the SessionLog START events (TensorBoard's purge markers) in the event files."""
    from tensorboardX.proto import event_pb2

    steps = []
    for path in sorted((run_dir / "tensorboard").iterdir()):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            if event.HasField("session_log") and event.session_log.status == 1:
                steps.append(event.step)
    return steps


def test_a_crash_and_resume_log_one_row_per_step_and_the_uninterrupted_summary(tokenizer, tmp_path):
    steps = dict(num_steps=4, checkpoint_every=2, eval_every=2)
    run(tokenizer, config(tmp_path / "a", **steps))
    want_rows = rows(tmp_path / "a" / "run")
    # metric calls: 2 (eval at 0) + 6 + 6 + 2 (eval at 2) + 6 + 3: the crash falls in step 4,
    # after step 3 was logged but not checkpointed (the checkpoint is at 2)
    with pytest.raises(Crash):
        run(tokenizer, config(tmp_path / "b", **steps), metric=RaiseAtCall(26, Crash))
    run_dir = tmp_path / "b" / "run"
    assert [r["step"] for r in rows(run_dir) if "loss" in r] == [1.0, 2.0, 3.0]
    (run_dir / "run.lock").write_text(json.dumps({"pid": 99999999, "host": "h", "since": 0}))
    run(tokenizer, config(tmp_path / "b", resume=True, **steps))
    got_rows = rows(run_dir)

    def measured(key):  # timings differ from run to run; compiles (perf/) recur after a resume
        return "time" in key or "per_s" in key or key.startswith("perf/")

    def numbers(rs):
        return [{k: v for k, v in r.items() if not measured(k)} for r in rs]

    assert numbers(got_rows) == numbers(want_rows)
    want = json.loads((tmp_path / "a" / "run" / "summary.json").read_text())
    got = json.loads((run_dir / "summary.json").read_text())
    assert got.pop("wall_seconds") > 0 and want.pop("wall_seconds") > 0
    assert got == want and got["eval_reward_before"] == want_rows[0]["eval_reward"]
    assert tensorboard_purges(run_dir)[-1] == 3  # the rows of step 3 and after are replaced

    # resuming a finished run changes nothing
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    run(tokenizer, config(tmp_path / "b", resume=True, **steps))
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


def test_an_unwritable_log_saves_the_completed_step_and_a_resume_writes_its_row(
    tokenizer, tmp_path
):
    """metrics.jsonl turns into a folder during step 2's rollouts (a log that can no longer be
    written): step 2's update completes, its state is checkpointed (none was due), the error
    says so in one line, and once the file is back a resume ends with one row per step, step
    2's included (the checkpoint carried it)."""
    steps = dict(num_steps=3, checkpoint_every=10, eval_every=100)
    run_dir = tmp_path / "b" / "run"
    log, aside = run_dir / "metrics.jsonl", run_dir / "metrics.jsonl.aside"
    calls = []

    def breaks_the_log(example, prediction):
        calls.append(1)
        if len(calls) == 2 + 6 + 1:  # eval at 0 (2 calls), step 1 (6), then step 2
            log.rename(aside)
            log.mkdir()
        return reward(example, prediction)

    with pytest.raises(UserError) as caught:
        run(tokenizer, config(tmp_path / "b", **steps), metric=breaks_the_log)
    assert str(caught.value) == f"{log} cannot be written (Is a directory)"
    assert caught.value.__notes__ == [
        f"the checkpoint of step 2 is in {str(run_dir)!r}; resume=true continues the run"
    ]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["2"]
    log.rmdir()
    aside.rename(log)
    assert [r["step"] for r in rows(run_dir)] == [0.0, 1.0]  # eval at 0, step 1
    run(tokenizer, config(tmp_path / "b", resume=True, **steps))
    logged = rows(run_dir)
    assert [r["step"] for r in logged] == [0.0, 1.0, 2.0, 3.0, 3.0]  # ... step 3, eval at 3
    assert [r["step"] for r in logged if "loss" in r] == [1.0, 2.0, 3.0]


def test_a_resume_with_a_changed_config_is_refused_listing_the_differences(tokenizer, tmp_path):
    run(tokenizer, config(tmp_path, num_steps=1, eval_every=100))
    changed = config(
        tmp_path,
        num_steps=3,
        eval_every=100,
        resume=True,
        seed=1,
        optim=mmgrpo_jax.OptimConfig(lr=1e-3, micro_batch_size=8, decay="linear"),
    )
    with pytest.raises(UserError, match=r"optim.lr: 0.05 -> 0.001, seed: 0 -> 1; resume with"):
        run(tokenizer, changed)


# ---------------------------------------------------------------- a metric that always fails


def test_a_metric_that_raises_on_every_rollout_stops_the_run(tokenizer, tmp_path):
    def broken(example, prediction):
        raise KeyError("answer")

    cfg = config(tmp_path, num_steps=5, eval_every=100, max_failed_steps=2, checkpoint_every=10)
    with pytest.raises(
        UserError,
        match=r"step 2: 6 of 6 rollouts raised, 2 steps in a row .*"
        r"metric raised KeyError: 'answer'",
    ):
        run(tokenizer, cfg, metric=broken)
    assert [r["step"] for r in rows(tmp_path / "run") if "loss" in r] == [
        1.0
    ]  # step 2 was never trained on


def test_a_row_the_program_cannot_take_is_refused_before_anything_runs(tokenizer, tmp_path):
    model = new_model(tokenizer)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    cfg = config(tmp_path, eval_every=100)
    trainer = MMGRPO(reward, cfg, model=model, tokenizer=tokenizer, stop_token_ids=stop)
    odd = Example(query="q?", answer="x").with_inputs("query")
    with pytest.raises(
        UserError,
        match=r"^valset\[1\]: TwoModules.forward\(question\) cannot take its inputs "
        r"\['query'\] \(missing a required argument: 'question'\)$",
    ):
        trainer.compile(TwoModules(), TRAIN, [VAL[0], odd])
    assert not (tmp_path / "run").exists()


def test_a_program_that_raises_on_every_call_stops_the_run_naming_the_error():
    """Every rollout an error carrying its exception; the guard stops the run after
    max_failed_steps such steps (compile saves the last completed step first)."""
    trajectories = run_rollouts(
        TwoStep(crash=True), [EXAMPLE], exact, num_rollouts=3, lm=ScriptedLM(lambda m: GOOD)
    )
    assert {(t.status, t.reward, t.error) for t in trajectories} == {
        ("error", 0.0, "program raised ZeroDivisionError: tool failed")
    }
    guard = Guard(mmgrpo_jax.MMGRPOConfig(max_failed_steps=2, num_rollouts=3))
    guard.check_rollouts(trajectories, step=0)
    with pytest.raises(
        UserError,
        match=r"^step 2: 3 of 3 rollouts raised, 2 steps in a row \(max_failed_steps=2\); "
        r"the first: program raised ZeroDivisionError: tool failed$",
    ):
        guard.check_rollouts(trajectories, step=1)


# ---------------------------------------------------------------- the pieces, one by one


def test_a_cut_short_metrics_line_is_dropped_on_resume(tmp_path, caplog):
    from mmgrpo_jax.trainer.run_log import RunLogger

    (tmp_path / "metrics.jsonl").write_text('{"step": 1.0, "loss": 0.5}\n{"step": 2.0, "lo')
    with caplog.at_level(logging.WARNING):
        log = RunLogger(tmp_path, tensorboard=False, resumed_step=1)
    assert log.history == [{"step": 1.0, "loss": 0.5}]
    assert "line 2 is cut short" in caplog.text


def test_signals_held_back_raise_when_the_block_ends_and_ignored_ones_stay_ignored():
    from mmgrpo_jax.trainer.interrupt import StopSignals

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
            with pytest.raises(Interrupted) as caught, stop.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                reached = True  # the block runs to its end
            assert reached and caught.value.exit_code == 130
        with pytest.raises(Interrupted), StopSignals() as stop:
            stop.hold()
            os.kill(os.getpid(), signal.SIGINT)
            finished = True
        assert finished
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_signal_whose_stop_python_drops_in_a_callback_is_delivered_again():
    """A signal that lands in a finalizer or a gc callback (XLA registers one) raises there,
    and Python drops what such a callback raises: the stop must not be lost with it."""
    import time

    from mmgrpo_jax.trainer.interrupt import StopSignals

    class SignalledWhileFinalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs here, inside __del__
                pass

    hook = sys.unraisablehook
    with pytest.raises(Interrupted) as caught, StopSignals():
        SignalledWhileFinalized()  # finalized at once: the handler raises inside __del__
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.01)
        reached_the_deadline = True
    assert caught.value.signal_name == "SIGTERM"
    assert "reached_the_deadline" not in locals()
    assert sys.unraisablehook is hook  # restored


def test_a_run_dir_that_cannot_be_made_is_a_user_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"run_dir .*file/run"):
        RunLock(tmp_path / "file" / "run").acquire()
