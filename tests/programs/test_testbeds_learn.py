"""The testbeds that have been seen to learn, at the budget of their sweep files (minutes each)."""

import pytest

from mmgrpo_jax.cli.demo import DemoConfig, run_demo


@pytest.mark.slow
def test_the_tiny_policy_learns_the_long_chain(tmp_path):
    """Seed 0, module-level, 100 steps of 8 examples (experiments/sweeps/testbed_long_chain.yaml):
    the fraction of right hops went 0.06 -> 0.56 on the development machine."""
    config = DemoConfig(
        testbed="long_chain",
        num_steps=100,
        examples_per_step=8,
        run_dir=str(tmp_path),
        progress=False,
    )
    summary = run_demo(config)
    assert summary["eval_reward_after"] >= 0.4
    assert summary["eval_reward_after"] - summary["eval_reward_before"] >= 0.3
