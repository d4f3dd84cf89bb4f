"""A config built in Python is refused as the command line refuses it: one line naming the
field, before any rule compares a string with a number."""

import numpy as np
import pytest

from mmgrpo_jax import LossConfig, MMGRPOConfig, OptimConfig, SamplerConfig
from mmgrpo_jax.commands.demo import DemoConfig
from programs.tasks import TaskConfig


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MMGRPOConfig(num_rollouts="4"), "MMGRPOConfig.num_rollouts must be int, got '4'"),
        (lambda: MMGRPOConfig(num_rollouts=4.0), "MMGRPOConfig.num_rollouts must be int, got 4.0"),
        (
            lambda: MMGRPOConfig(num_rollouts=True),
            "MMGRPOConfig.num_rollouts must be int, got True",
        ),
        (
            lambda: MMGRPOConfig(sampler={"max_completion_tokens": 4}),
            "MMGRPOConfig.sampler must be SamplerConfig, got {'max_completion_tokens': 4}",
        ),
        (lambda: SamplerConfig(temperature="hot"), "SamplerConfig.temperature must be float"),
        (lambda: OptimConfig(lr="1e-5"), "OptimConfig.lr must be float, got '1e-5'"),
        (lambda: LossConfig(beta=None), "LossConfig.beta must be float, got None"),
        (lambda: DemoConfig(seed="0"), "DemoConfig.seed must be int, got '0'"),
        (lambda: TaskConfig(split_seed=1.5), "TaskConfig.split_seed must be int, got 1.5"),
        (lambda: MMGRPOConfig(model_path=3), "MMGRPOConfig.model_path must be str | None, got 3"),
    ],
)
def test_a_value_of_the_wrong_type_is_named(build, message):
    with pytest.raises(ValueError) as caught:
        build()
    assert str(caught.value).startswith(message)


def test_numbers_of_any_kind_and_ints_for_floats_are_accepted():
    config = MMGRPOConfig(num_rollouts=np.int64(4), optim=OptimConfig(lr=1))
    assert config.num_rollouts == 4 and config.optim.lr == 1
    assert SamplerConfig(temperature=np.float32(0.7)).temperature == pytest.approx(0.7)
