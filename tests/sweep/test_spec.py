from pathlib import Path

import pytest

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.sweep.runner import check_runs
from mmgrpo_jax.sweep.spec import load_sweep, parse_grid, parse_seeds

REPO = Path(__file__).resolve().parents[2]


def test_seeds_are_ranges_lists_or_single_values():
    assert parse_seeds("0-3") == (0, 1, 2, 3)
    assert parse_seeds("0-2,7") == (0, 1, 2, 7)
    assert parse_seeds([4, 1]) == (4, 1)
    assert parse_seeds(5) == (5,)
    for bad in ("3-1", "a", "1-", True):
        with pytest.raises(UserError, match="seeds"):
            parse_seeds(bad)
    with pytest.raises(UserError, match="distinct"):
        load_sweep(None, command="demo", seeds="0,0")


def test_a_command_line_grid_and_a_file_grid_make_the_same_cells():
    line = load_sweep(None, command="demo", grid="grouping=module,trajectory loss=grpo,dapo")
    file = load_sweep(
        None, command="demo", grid={"grouping": ["module", "trajectory"], "loss": ["grpo", "dapo"]}
    )
    assert line.cells == file.cells
    assert [c.name for c in line.cells] == [
        "grouping=module loss=grpo",
        "grouping=module loss=dapo",
        "grouping=trajectory loss=grpo",
        "grouping=trajectory loss=dapo",
    ]
    assert line.cells[1].overrides == ("grouping=module", "loss=dapo")


def test_a_bundle_sets_several_keys_and_keeps_yaml_scalars():
    (axis,) = parse_grid({"loss": {"dapo": {"loss": "dapo", "epsilon_high": 0.28, "beta": None}}})
    assert axis.values[0].label == "dapo"
    assert axis.values[0].overrides == ("loss=dapo", "epsilon_high=0.28", "beta=null")


def test_every_run_gets_its_seed_folder_and_resume():
    config = load_sweep(
        None,
        command="train",
        grid="mmgrpo.grouping=module",
        seeds="3",
        out="/tmp/s",
        overrides=["mmgrpo.num_steps=5"],
    )
    (cell,) = config.cells
    assert config.run_overrides(cell, 3) == [
        "mmgrpo.num_steps=5",
        "mmgrpo.grouping=module",
        "mmgrpo.seed=3",
        "mmgrpo.run_dir=/tmp/s/runs/mmgrpo.grouping-module/seed3",
        "mmgrpo.resume=true",
        "mmgrpo.progress=false",
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"command": "dance"}, "command must be one of"),
        ({"command": "demo", "grid": "seed=1,2"}, "sets 'seed', which the sweep sets"),
        ({"command": "demo", "grid": "lr=1,1"}, "repeats a value"),
        ({"command": "demo", "grid": "lr"}, "must look like key=value1,value2"),
        ({"command": "demo", "grid": "lr=1,2", "baseline": "lr=3"}, "names no cell"),
        ({"command": "demo", "jobs": 0}, "jobs must be >= 1"),
        ({"command": "demo", "overrides": ["lr"]}, "must look like key=value"),
        ({"command": "demo", "colour": "red"}, "unknown keys \\['colour'\\]"),
        ({"command": "demo", "config": "/no/such.yaml"}, "is not a file"),
    ],
)
def test_bad_sweep_values_name_themselves(values, message):
    with pytest.raises(UserError, match=message):
        load_sweep(None, **values)


def test_the_committed_sweep_files_build_every_run_config():
    paths = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))
    assert len(paths) >= 5
    for path in paths:
        config = load_sweep(path)
        check_runs(config)  # every cell's DemoConfig validates
        assert config.out.startswith("experiments/results/"), path


def test_values_that_clean_to_one_folder_are_refused():
    with pytest.raises(UserError, match="name the same run folder"):
        load_sweep(None, command="demo", grid={"loss": {"a b": {"loss": "grpo"}, "a/b": {}}})


def test_jobs_must_be_a_whole_number():
    with pytest.raises(UserError, match=r"jobs must be int, got 2\.7"):
        load_sweep(None, command="demo", jobs=2.7)


def test_command_line_overrides_go_after_the_files():
    config = load_sweep(
        REPO / "experiments" / "sweeps" / "testbed_counter.yaml", overrides=["num_steps=20"]
    )
    assert config.overrides[0] == "testbed=counter" and config.overrides[-1] == "num_steps=20"


def test_a_run_is_identified_by_its_resolved_config_not_its_folder():
    one = load_sweep(None, command="demo", grid="lr=0.01", out="/tmp/a")
    other = load_sweep(None, command="demo", grid="lr=0.01", out="/elsewhere/b")
    (cell,) = one.cells
    assert one.identity(cell, 0) == other.identity(cell, 0)
    assert one.identity(cell, 0)["config"]["head_scale"] == 0.25  # defaults are part of it
    assert one.identity(cell, 0) != one.identity(cell, 1)
