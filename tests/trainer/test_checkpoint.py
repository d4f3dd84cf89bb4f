import jax
import numpy as np
import optax
import pytest

from mmgrpo_jax.rl.step import split_for_training
from mmgrpo_jax.testing import tiny_decoder
from mmgrpo_jax.trainer.checkpoint import Checkpointer


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
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        Checkpointer(tmp_path, resume=False)


def test_a_checkpoint_without_engine_state_is_refused_by_name(tmp_path):
    checkpoints = Checkpointer(tmp_path, resume=False)
    checkpoints.save(1, state_of(0), None, {"sampler_calls": 2})  # the layout before the engine
    checkpoints.close()
    with pytest.raises(ValueError, match=r"step 1 .* older mmgrpo-jax .* start a fresh run_dir"):
        Checkpointer(tmp_path, resume=True).restore(state_of(0), None)
