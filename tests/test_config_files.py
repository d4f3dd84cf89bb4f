import dataclasses

import pytest

from mmgrpo_jax.config_files import load_config
from mmgrpo_jax.rl.losses import LossConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    steps: int = 10
    lr: float = 1e-5
    loss: LossConfig = dataclasses.field(default_factory=lambda: LossConfig("grpo"))


def test_yaml_then_overrides_with_nested_sections(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 5\nloss:\n  variant: dapo\n  epsilon: 0.3\n")
    cfg = load_config(RunConfig, path, ["lr=0.002", "loss.beta=0.04", "name=my run"])
    assert cfg == RunConfig(
        name="my run", steps=5, lr=0.002, loss=LossConfig("dapo", epsilon=0.3, beta=0.04)
    )


def test_partial_nested_override_keeps_the_default_section():
    cfg = load_config(RunConfig, None, ["loss.epsilon=0.1"])
    assert cfg.loss == LossConfig("grpo", epsilon=0.1)
    assert cfg.loss.eps_high == 0.1  # not frozen at the old default


@dataclasses.dataclass(frozen=True)
class OuterConfig:
    run: RunConfig = dataclasses.field(default_factory=lambda: RunConfig(steps=7))
    seed: int = 0


def test_two_levels_of_sections_keep_every_default_not_overridden():
    cfg = load_config(OuterConfig, None, ["run.loss.beta=0.1", "run.lr=0.5"])
    assert cfg == OuterConfig(RunConfig(steps=7, lr=0.5, loss=LossConfig("grpo", beta=0.1)))
    assert load_config(OuterConfig) == OuterConfig()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["stepz=3"], r"unknown RunConfig keys \['stepz'\]"),
        (
            ["loss.epsilom=3"],
            r"unknown LossConfig keys \['loss.epsilom'\] \(did you mean \['loss.epsilon'\]\?\); "
            r"valid: \['loss.aggregation', 'loss.beta', 'loss.delta', 'loss.epsilon', ",
        ),
        (["steps"], "must look like key=value"),
        (["loss.variant=ppo"], "got 'ppo'"),
        (["steps.x=1"], "'steps' is not a section"),
    ],
)
def test_bad_overrides_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(RunConfig, None, overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        load_config(RunConfig, tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("steps=ten", "steps must be int, got 'ten'"),
        ("steps=true", "steps must be int, got True"),
        ("lr=fast", "lr must be float, got 'fast'"),
        ("loss.max_completion_length=1.5", r"must be int \| None, got 1\.5"),
    ],
)
def test_scalar_types_are_checked(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(RunConfig, None, [override])


def test_int_is_accepted_for_float_and_none_for_optional():
    cfg = load_config(RunConfig, None, ["lr=1", "loss.epsilon_high=null"])
    assert cfg.lr == 1 and cfg.loss.epsilon_high is None
