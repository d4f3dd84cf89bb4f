import subprocess

import jax
import numpy as np
import optax
import pytest

from mmgrpo_jax.rl.step import split_for_training
from mmgrpo_jax.testing import tiny_decoder
from mmgrpo_jax.trainer.checkpoint import Checkpointer, CheckpointWriteError


def state_of(seed):
    _, state, _ = split_for_training(tiny_decoder(32, seed=seed), optax.adam(1e-3), seed=seed)
    return state


def test_a_checkpoint_round_trips_state_and_metadata(tmp_path):
    checkpoints = Checkpointer(tmp_path, resume=False)
    saved = state_of(0)
    checkpoints.save(3, saved, None, {"engine": {"sampled_dispatches": 7}, "program": {}})
    checkpoints.close()
    restored = Checkpointer(tmp_path, resume=True).restore(state_of(1), None)
    assert restored.step == 3 and restored.meta["engine"] == {"sampled_dispatches": 7}
    jax.tree.map(np.testing.assert_array_equal, saved, restored.state)
    assert Checkpointer(tmp_path / "fresh", resume=True).restore(state_of(1), None) is None
    with pytest.raises(ValueError, match="already holds a run's checkpoints"):
        Checkpointer(tmp_path, resume=False)


def test_a_checkpoint_without_engine_state_is_refused_by_name(tmp_path):
    checkpoints = Checkpointer(tmp_path, resume=False)
    checkpoints.save(1, state_of(0), None, {"sampler_calls": 2})  # the layout before the engine
    checkpoints.close()
    with pytest.raises(ValueError, match=r"step 1 .* older mmgrpo-jax .* start a fresh run_dir"):
        Checkpointer(tmp_path, resume=True).restore(state_of(0), None)


# ---------------------------------------------------------- a checkpoint that cannot be written


@pytest.fixture
def small_disk(tmp_path):
    """A 96 KB filesystem: one tiny checkpoint (~60 KB) fits, a second does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"mounting a small tmpfs needs root: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_is_one_error_naming_the_last_intact_checkpoint(small_disk, caplog):
    checkpoints = Checkpointer(small_disk / "run", resume=False)
    meta = {"engine": {}, "program": {}}
    checkpoints.save(1, state_of(0), None, meta)
    with pytest.raises(CheckpointWriteError) as caught:
        checkpoints.save(2, state_of(1), None, meta)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"the checkpoint of step 2 could not be written to '{small_disk / 'run' / 'checkpoints'}' "
        "(no space left on device; "
    )
    assert message.endswith(
        "MB free there); the last intact checkpoint: step 1; make room and run again with "
        "resume=true"
    )
    assert "Traceback" not in caplog.text  # orbax's per-thread reports are summed up above
    checkpoints.close()
    # the partial write is gone (its space is the user's again); step 1 restores
    assert sorted(p.name for p in (small_disk / "run" / "checkpoints").iterdir()) == ["1"]
    restored = Checkpointer(small_disk / "run", resume=True).restore(state_of(2), None)
    assert restored.step == 1
    jax.tree.map(np.testing.assert_array_equal, state_of(0), restored.state)


def test_a_failing_write_without_a_checkpoint_says_a_resume_starts_at_step_0(tmp_path, monkeypatch):
    """Any write failure (here a read-only folder as orbax reports it, injected) is the same
    one line; with no intact checkpoint it says so."""
    checkpoints = Checkpointer(tmp_path / "run", resume=False)

    def refuse(*args, **kwargs):
        raise ValueError("PERMISSION_DENIED: Error writing local file: Read-only file system")

    monkeypatch.setattr(checkpoints._manager, "save", refuse)
    with pytest.raises(
        CheckpointWriteError,
        match=r"\(ValueError: PERMISSION_DENIED: .*; "
        r".* MB free there\); the last intact checkpoint: none \(a resume starts "
        r"at step 0\)",
    ):
        checkpoints.save(1, state_of(0), None, {"engine": {}, "program": {}})
    checkpoints.close()
