import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.sweep import load_sweep, run_sweep, runner
from mmgrpo_jax.trainer.run_lock import RunLock
from tests.sweep.fake_run import curve_value
from tests.sweep.fake_sweep import fake_command_line

REPO = Path(__file__).resolve().parents[2]
GRID = "lr=0.002,0.004"


def _config(out: Path, **values):
    defaults = {"command": "demo", "grid": GRID, "seeds": "0-2", "threshold": 0.5}
    return load_sweep(None, out=str(out), overrides=["num_steps=6"], **{**defaults, **values})


@pytest.fixture
def fake_runs(monkeypatch):
    monkeypatch.setattr(runner, "command_line", fake_command_line)
    monkeypatch.setattr(runner, "POLL_S", 0.02)
    monkeypatch.setenv("FAKE_STEP_SECONDS", "0.01")


def _without_wall_time(text: str) -> list[dict[str, str]]:
    rows = list(csv.DictReader(io.StringIO(text)))
    for row in rows:
        for key in ("wall_seconds", "wall_seconds_mean", "run_dir"):
            row.pop(key, None)
    return rows


def test_sweep_runs_every_cell_and_seed_and_writes_the_report(tmp_path, fake_runs):
    config = _config(tmp_path / "sweep", jobs=2)
    report = run_sweep(config, progress=False)
    assert not report.failures and report.skipped == 0
    assert len(report.results) == 6
    for result in report.results:
        lr = float(dict(result.cell.labels)["lr"])
        assert result.score == curve_value(result.seed, lr, 6)
        assert [s for s, _ in result.curve] == [1, 2, 3, 4, 5, 6]
    table = list(csv.DictReader((tmp_path / "sweep" / "table.csv").open()))
    assert [row["lr"] for row in table] == ["0.002", "0.004"]
    fast = [curve_value(s, 0.004, 6) for s in range(3)]
    assert float(table[1]["score_mean"]) == pytest.approx(sum(fast) / 3)
    # lr 0.004 reaches 0.5 at step 2 (seeds 0-2 add 0, 0.05, 0.1); lr 0.002 at steps 3, 3, 2
    assert (table[1]["reached"], table[1]["median_steps_to_threshold"]) == ("3", "2.0")
    assert table[0]["median_steps_to_threshold"] == "3.0"
    baseline = [curve_value(s, 0.002, 6) for s in range(3)]
    diff = sum(f - b for f, b in zip(fast, baseline, strict=True)) / 3
    assert float(table[1]["diff_mean"]) == pytest.approx(diff)
    assert table[1]["diff_seeds"] == "3"
    markdown = (tmp_path / "sweep" / "table.md").read_text()
    assert "| 0.002 | 3/3 |" in markdown and "baseline" in markdown
    assert (tmp_path / "sweep" / "curves.png").stat().st_size > 0
    assert (tmp_path / "sweep" / "profiles.png").stat().st_size > 0  # rliable's profiles
    runs = list(csv.DictReader((tmp_path / "sweep" / "runs.csv").open()))
    assert [(r["lr"], r["seed"]) for r in runs] == [
        (lr, str(s)) for lr in ("0.002", "0.004") for s in range(3)
    ]


def test_runs_go_seed_by_seed_so_a_stopped_sweep_pairs_its_cells(tmp_path, fake_runs, monkeypatch):
    launched = []

    def recorded(config, cell, seed):
        launched.append((dict(cell.labels)["lr"], seed))
        return fake_command_line(config, cell, seed)

    monkeypatch.setattr(runner, "command_line", recorded)
    run_sweep(_config(tmp_path / "sweep", seeds="0-1", jobs=1), progress=False)
    assert launched == [("0.002", 0), ("0.004", 0), ("0.002", 1), ("0.004", 1)]


def test_a_restarted_sweep_skips_finished_runs(tmp_path, fake_runs):
    config = _config(tmp_path / "sweep")
    run_sweep(config, progress=False)
    first = (tmp_path / "sweep" / "table.csv").read_text()
    again = run_sweep(config, progress=False)
    assert again.skipped == 6
    assert _without_wall_time((tmp_path / "sweep" / "table.csv").read_text()) == (
        _without_wall_time(first)
    )
    logs = (config.run_dir(config.cells[0], 0) / runner.LOG).read_text()
    assert logs.count("=== ") == 1  # launched once


def test_report_only_starts_nothing_and_tables_the_finished_runs(tmp_path, fake_runs):
    run_sweep(_config(tmp_path / "sweep", seeds="0-1"), progress=False)  # 4 of the 6 runs
    wider = _config(tmp_path / "sweep")
    report = run_sweep(wider, progress=False, report_only=True)
    assert report.skipped == 4 and len(report.results) == 4 and not report.failures
    assert not wider.run_dir(wider.cells[0], 2).exists()  # seed 2 not started
    markdown = (tmp_path / "sweep" / "table.md").read_text()
    assert "| 0.002 | 2/3 |" in markdown and "| 0.004 | 2/3 |" in markdown
    assert "(n=2, no interval) |" in markdown and "no interval) (n=" not in markdown  # n once


def test_a_run_folder_of_another_setting_is_refused(tmp_path, fake_runs):
    run_sweep(_config(tmp_path / "sweep", seeds="0"), progress=False)
    changed = load_sweep(
        None,
        command="demo",
        grid=GRID,
        seeds="0",
        out=str(tmp_path / "sweep"),
        overrides=["num_steps=5"],
    )
    with pytest.raises(UserError, match=r"another setting \(num_steps: 6 -> 5\)"):
        run_sweep(changed, progress=False)


def test_a_failed_run_is_reported_and_the_others_finish(tmp_path, fake_runs, monkeypatch):
    def one_fails(config, cell, seed):
        extra = ["fail=1"] if (dict(cell.labels)["lr"], seed) == ("0.004", 1) else []
        return [*fake_command_line(config, cell, seed), *extra]

    monkeypatch.setattr(runner, "command_line", one_fails)
    report = run_sweep(_config(tmp_path / "sweep"), progress=False)
    assert [(f.seed, f.exit_code) for f in report.failures] == [(1, 1)]
    assert "failing on purpose" in report.failures[0].last_line
    assert len(report.results) == 5
    table = list(csv.DictReader((tmp_path / "sweep" / "table.csv").open()))
    assert table[1]["runs"] == "2" and table[1]["diff_seeds"] == "2"  # paired on shared seeds


def test_a_run_that_exits_2_is_one_failed_run(tmp_path, fake_runs, monkeypatch):
    """Configs were all built before the start, so an exit 2 is that run's folder, checkpoint
    or machine: the run fails and the others go on."""

    def first_refuses(config, cell, seed):
        extra = ["fail=2"] if (dict(cell.labels)["lr"], seed) == ("0.002", 0) else []
        return [*fake_command_line(config, cell, seed), *extra]

    monkeypatch.setattr(runner, "command_line", first_refuses)
    report = run_sweep(_config(tmp_path / "sweep", jobs=2), progress=False)
    assert [(f.seed, f.exit_code) for f in report.failures] == [(0, 2)]
    assert len(report.results) == 5


def test_a_cut_metrics_line_is_dropped_and_an_unreadable_run_fails_alone(
    tmp_path, fake_runs, caplog
):
    """One finished run's metrics.jsonl loses its tail (a kill mid-write), another's summary is
    cut, and a third run has not started: the sweep warns about the line, reports the cut
    summary as that run's failure, and runs the missing one."""
    run_sweep(_config(tmp_path / "sweep", seeds="0"), progress=False)
    config = _config(tmp_path / "sweep", seeds="0-1")
    cut_log = config.run_dir(config.cells[0], 0) / "metrics.jsonl"
    with cut_log.open("r+") as f:
        f.truncate(cut_log.stat().st_size - 15)
    summary = config.run_dir(config.cells[1], 0) / "summary.json"
    summary.write_text(summary.read_text()[:20])
    report = run_sweep(config, progress=False)
    lines = len(cut_log.read_text().splitlines())
    assert f"{cut_log} line {lines} is cut short" in caplog.text
    assert [(f.cell, f.seed, f.exit_code, f.log) for f in report.failures] == [
        (config.cells[1], 0, None, summary)
    ]
    assert "JSONDecodeError" in report.failures[0].last_line
    assert "whose folders are not here" not in caplog.text  # reported once, as failed
    assert sorted((r.cell.name, r.seed) for r in report.results) == [
        (config.cells[0].name, 0),
        (config.cells[0].name, 1),
        (config.cells[1].name, 1),
    ]
    curve = next(r.curve for r in report.results if r.cell == config.cells[0] and r.seed == 0)
    assert [s for s, _ in curve] == [1, 2, 3, 4, 5]  # the cut step-6 row is dropped


def test_a_sweep_out_that_is_a_file_is_named_as_the_sweeps(tmp_path, fake_runs):
    (tmp_path / "out").write_text("not a folder")
    config = _config(tmp_path / "out", seeds="0")
    with pytest.raises(UserError, match=r"^sweep out '.*out': (File exists|Not a directory)$"):
        run_sweep(config, progress=False)


def test_a_bad_grid_value_is_refused_before_any_run(tmp_path, fake_runs):
    config = load_sweep(None, command="demo", grid="grouping=module,sideways", out=str(tmp_path))
    with pytest.raises(UserError, match=r"cell grouping=sideways: .*grouping must be"):
        run_sweep(config, progress=False)
    assert not (tmp_path / "runs").exists()


def _sweep_process(out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    command = [
        sys.executable,
        str(REPO / "tests" / "sweep" / "fake_sweep.py"),
        "sweep",
        "--command",
        "demo",
        "--grid",
        GRID,
        "--seeds",
        "0-1",
        "--out",
        str(out),
        "--threshold",
        "0.5",
        "num_steps=8",
        *extra,
    ]
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_a_sweep_killed_mid_run_and_started_again_ends_with_the_same_table(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_STEP_SECONDS": "0.3"}
    reference = _sweep_process(tmp_path / "reference", env)
    interrupted = _sweep_process(tmp_path / "interrupted", env)
    checkpoint = tmp_path / "interrupted" / "runs" / "lr-0.002" / "seed1" / "ckpt.json"
    deadline = time.monotonic() + 120
    while not checkpoint.is_file() or json.loads(checkpoint.read_text())["step"] < 3:
        assert time.monotonic() < deadline and interrupted.poll() is None
        time.sleep(0.05)
    interrupted.kill()  # SIGKILL: no handler runs in the sweep
    interrupted.wait()
    deadline = time.monotonic() + 30
    while True:  # the orphaned child got SIGTERM from the kernel, and exits
        try:
            with RunLock(checkpoint.parent):
                break
        except UserError:
            assert time.monotonic() < deadline, "the killed sweep's child kept running"
            time.sleep(0.05)
    assert json.loads(checkpoint.read_text())["step"] < 8
    restarted = _sweep_process(tmp_path / "interrupted", env)
    assert restarted.communicate(timeout=120) and restarted.returncode == 0
    assert reference.communicate(timeout=120) and reference.returncode == 0
    for name in ("table.csv", "runs.csv"):
        done = (tmp_path / "interrupted" / name).read_text()
        assert _without_wall_time(done) == _without_wall_time(
            (tmp_path / "reference" / name).read_text()
        )
    log = (checkpoint.parent / runner.LOG).read_text()
    assert log.count("=== ") == 2  # the killed run was resumed, not restarted
    first = tmp_path / "interrupted" / "runs" / "lr-0.002" / "seed0" / runner.LOG
    assert first.read_text().count("=== ") == 1  # the finished one was skipped


def test_a_score_the_runs_do_not_write_is_named(tmp_path, fake_runs):
    config = _config(tmp_path / "sweep", seeds="0", score="accuracy")
    with pytest.raises(UserError, match=r"no 'accuracy'.*'eval_reward_after'"):
        run_sweep(config, progress=False)


def test_sigterm_stops_every_run_and_the_same_sweep_finishes_them(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_STEP_SECONDS": "0.3"}
    out = tmp_path / "sweep"
    sweep = _sweep_process(out, env, "--jobs", "2")
    # runs go seed by seed: the first two are both cells' seed 0
    checkpoints = [out / "runs" / f"lr-{lr}" / "seed0" / "ckpt.json" for lr in ("0.002", "0.004")]
    deadline = time.monotonic() + 120
    while not all(c.is_file() for c in checkpoints):  # both runs are under way
        assert time.monotonic() < deadline and sweep.poll() is None
        time.sleep(0.05)
    sweep.send_signal(signal.SIGTERM)
    _, stderr = sweep.communicate(timeout=60)
    assert sweep.returncode == 143, stderr
    assert "stopped by SIGTERM" in stderr and "runs finished" in stderr
    for checkpoint in checkpoints:  # no run outlived the sweep: their folders are free
        with RunLock(checkpoint.parent):
            pass
        assert json.loads(checkpoint.read_text())["step"] < 8
    again = _sweep_process(out, env, "--jobs", "2")
    _, stderr = again.communicate(timeout=120)
    assert again.returncode == 0, stderr
    assert len(list(csv.DictReader((out / "runs.csv").open()))) == 4


def test_report_only_reports_runs_whose_folders_are_gone_from_runs_csv(tmp_path, fake_runs, caplog):
    """A fresh clone has the committed tables but not the run folders: --report-only re-reports
    the table from runs.csv's record (the same rows, no run lost), leaves curves.png as it was,
    and says so; a real sweep warns and redoes the runs."""
    config = _config(tmp_path / "sweep", seeds="0-2")
    run_sweep(config, progress=False)
    sweep = tmp_path / "sweep"
    before = {p.name: p.read_bytes() for p in sweep.glob("*.*")}
    shutil.rmtree(sweep / "runs" / "lr-0.002" / "seed1")  # one run's folder gone ...
    shutil.rmtree(sweep / "runs" / "lr-0.004")  # ... and a whole cell's
    (sweep / "table.md").write_text("stale")
    report = run_sweep(config, progress=False, report_only=True)
    assert "records 4 finished run(s) whose folders are not here" in caplog.text
    assert len(report.results) == 6 and not report.failures
    after = {p.name: p.read_bytes() for p in sweep.glob("*.*")}
    for name in ("table.csv", "runs.csv"):  # wall times come back rounded as recorded
        assert _without_wall_time(after[name].decode()) == _without_wall_time(
            before[name].decode()
        ), name
    assert after["curves.png"] == before["curves.png"]
    assert (sweep / "profiles.png").stat().st_size > 0
    assert "3/3" in after["table.md"].decode() and "stale" not in after["table.md"].decode()
    caplog.clear()
    report = run_sweep(config, progress=False)
    assert "lists 4 finished run(s) whose folders are not here" in caplog.text
    assert len(report.results) == 6 and not report.failures
    assert not any(r.recorded for r in report.results)


def test_report_only_refuses_a_runs_csv_row_of_another_sweep(tmp_path, fake_runs):
    config = _config(tmp_path / "sweep", seeds="0")
    run_sweep(config, progress=False)
    runs_csv = tmp_path / "sweep" / "runs.csv"
    runs_csv.write_text(runs_csv.read_text().replace("0.002,", "0.5,", 1))
    shutil.rmtree(tmp_path / "sweep" / "runs")
    with pytest.raises(UserError, match=r"runs.csv row 2 .* is not a run of this sweep"):
        run_sweep(config, progress=False, report_only=True)


def test_a_better_together_run_is_finished_by_its_own_summary_not_its_weight_stages(tmp_path):
    config = load_sweep(
        None, command="better-together", out=str(tmp_path), grid="strategy=w,none", seeds="0"
    )
    cell = config.cells[0]
    run_dir = config.run_dir(cell, 0)
    run_dir.mkdir(parents=True)
    assert not runner._finished(config, cell, 0)
    summary = run_dir / "summary.json"
    summary.write_text(json.dumps({"steps": 20, "wall_seconds": 1.0}))  # the weight stage's
    assert not runner._finished(config, cell, 0)  # a relaunch resumes it
    summary.write_text(json.dumps({"strategy": "w", "test_after": 0.5, "wall_seconds": 2.0}))
    assert runner._finished(config, cell, 0)
    train = load_sweep(None, command="train", out=str(tmp_path / "t"), grid="seed_ish=1", seeds="0")
    train_dir = train.run_dir(train.cells[0], 0)
    train_dir.mkdir(parents=True)
    (train_dir / "summary.json").write_text(json.dumps({"steps": 20, "wall_seconds": 1.0}))
    assert runner._finished(train, train.cells[0], 0)  # a trainer's summary is its run's end


def test_diagnostics_average_each_run_then_each_cell_and_name_a_key_no_run_logged(
    tmp_path, fake_runs, caplog
):
    config = _config(tmp_path / "sweep", diagnostics="eval_reward,kl_typo", jobs=2)
    run_sweep(config, progress=False)
    rows = list(csv.DictReader((tmp_path / "sweep" / "diagnostics.csv").open()))
    assert [(r["lr"], r["key"]) for r in rows] == [
        (lr, key) for lr in ("0.002", "0.004") for key in ("eval_reward", "kl_typo")
    ]
    for row in rows[0::2]:
        per_run = [
            sum(curve_value(s, float(row["lr"]), step) for step in range(1, 7)) / 6
            for s in range(3)
        ]
        assert row["runs"] == "3"
        assert float(row["mean"]) == pytest.approx(sum(per_run) / 3)
        assert (float(row["min"]), float(row["max"])) == pytest.approx((min(per_run), max(per_run)))
    assert [(r["runs"], r["mean"]) for r in rows[1::2]] == [("0", ""), ("0", "")]
    text = (tmp_path / "sweep" / "diagnostics.md").read_text()
    assert "| 0.004 | 3 |" in text and "No finished run logged ['kl_typo']" in text
    assert "kl_typo" in caplog.text


def test_diagnostics_must_be_metric_keys(tmp_path):
    with pytest.raises(UserError, match="diagnostics names a key twice"):
        _config(tmp_path / "sweep", diagnostics="kl_mean,kl_mean")
    with pytest.raises(UserError, match="diagnostics must be a list"):
        _config(tmp_path / "sweep", diagnostics=[3])


def _sweep_file(path: Path, **values) -> Path:
    defaults = {"command": "demo", "overrides": ["num_steps=6"], "seeds": "0-2"}
    path.write_text(json.dumps({**defaults, **values}))  # JSON is YAML
    return path


def test_a_baseline_from_another_sweep_is_a_row_paired_by_seed_and_never_run_here(
    tmp_path, fake_runs, caplog
):
    owner = _sweep_file(
        tmp_path / "owner.yaml",
        out=str(tmp_path / "owner"),
        grid={"lr": [0.002, 0.004]},
        seeds="0-1",  # its seed 2 only when asked for on the command line
    )
    run_sweep(load_sweep(owner), progress=False)
    reference = {"sweep": str(owner), "cell": {"lr": 0.002}, "label": "shared"}
    config = load_sweep(
        _sweep_file(
            tmp_path / "other.yaml",
            out=str(tmp_path / "other"),
            grid={"lr": [0.001]},
            baseline_from=reference,
            diagnostics=["eval_reward"],
        )
    )
    report = run_sweep(config, progress=False)
    assert "lr=0.002 has not finished seeds [2]" in caplog.text
    assert not (tmp_path / "owner" / "runs" / "lr-0.002" / "seed2").exists()  # not run here
    assert not (tmp_path / "other" / "runs" / "lr-shared").exists()
    assert [(dict(r.cell.labels)["lr"], r.seed) for r in report.results] == [
        ("shared", 0), ("0.001", 0), ("shared", 1), ("0.001", 1), ("0.001", 2)
    ]  # fmt: skip
    table = list(csv.DictReader((tmp_path / "other" / "table.csv").open()))
    assert [(r["lr"], r["runs"]) for r in table] == [("shared", "2"), ("0.001", "3")]
    paired = [curve_value(s, 0.001, 6) - curve_value(s, 0.002, 6) for s in (0, 1)]
    assert float(table[1]["diff_mean"]) == pytest.approx(sum(paired) / 2)
    assert table[1]["diff_seeds"] == "2"
    markdown = (tmp_path / "other" / "table.md").read_text()
    assert "| shared | 2/3 |" in markdown and "| baseline |" in markdown
    assert f"baseline cell (lr=shared: lr=0.002 of {owner})" in markdown
    runs = list(csv.DictReader((tmp_path / "other" / "runs.csv").open()))
    assert runs[0]["run_dir"] == str(tmp_path / "owner" / "runs" / "lr-0.002" / "seed0")
    assert "| shared | 2 |" in (tmp_path / "other" / "diagnostics.md").read_text()
    # the owner runs seed 2 (beyond its file's seeds): the next report pairs all three
    run_sweep(load_sweep(owner, seeds="0-2"), progress=False)
    run_sweep(config, progress=False, report_only=True)
    table = list(csv.DictReader((tmp_path / "other" / "table.csv").open()))
    assert (table[0]["runs"], table[1]["diff_seeds"]) == ("3", "3")
    # the owner's folders gone (a fresh clone of the tables only): the baseline row stays, from
    # the owner's record (seed 2 too, beyond its file's seeds), not counted among runs to do
    first = _without_wall_time((tmp_path / "other" / "table.csv").read_text())
    shutil.rmtree(tmp_path / "owner" / "runs")
    caplog.clear()
    report = run_sweep(config, progress=False)
    assert "has not finished" not in caplog.text and "runs.csv" not in caplog.text
    assert _without_wall_time((tmp_path / "other" / "table.csv").read_text()) == first
    assert sum(r.recorded for r in report.results) == 3

    # a sweep that never reported that row (its own runs copied in): the owner's runs.csv alone
    def copy_own_runs():
        for seed in fresh.seeds:
            run_dir = tmp_path / "other" / "runs" / "lr-0.001" / f"seed{seed}"
            shutil.copytree(run_dir, fresh.run_dir(fresh.cells[0], seed))

    fresh = load_sweep(
        _sweep_file(
            tmp_path / "fresh.yaml",
            out=str(tmp_path / "fresh"),
            grid={"lr": [0.001]},
            baseline_from=reference,
        )
    )
    copy_own_runs()
    report = run_sweep(fresh, progress=False)
    assert "has not finished" not in caplog.text and report.skipped == 3
    assert _without_wall_time((tmp_path / "fresh" / "table.csv").read_text()) == first
    # with no record either, the seeds are named as not finished
    (tmp_path / "owner" / "runs.csv").unlink()
    shutil.rmtree(tmp_path / "fresh")
    copy_own_runs()
    run_sweep(fresh, progress=False)
    assert "has not finished seeds [0, 1, 2]" in caplog.text


def test_a_broken_baseline_run_is_named_as_the_other_sweeps_to_mend(tmp_path, fake_runs):
    owner = _sweep_file(tmp_path / "owner.yaml", out=str(tmp_path / "o"), grid={"lr": [0.002]})
    run_sweep(load_sweep(owner, seeds="0"), progress=False)
    config = load_sweep(
        None,
        command="demo",
        out=str(tmp_path / "s"),
        grid="lr=0.001",
        seeds="0",
        baseline_from={"sweep": str(owner), "cell": {"lr": 0.002}, "label": "shared"},
    )
    summary = tmp_path / "o" / "runs" / "lr-0.002" / "seed0" / "summary.json"
    summary.write_text("{not json")
    report = run_sweep(config, progress=False)
    (failure,) = report.failures
    assert failure.log == summary and f"is that sweep's: `mmgrpo sweep --sweep {owner}`" in (
        failure.last_line
    )
    assert failure.last_line.startswith(f"baseline_from {owner} lr=0.002: {summary} cannot be read")
    assert [dict(r.cell.labels)["lr"] for r in report.results] == ["0.001"]
    shutil.rmtree(summary.parent)  # a run of another setting in the owner's folder
    other = load_sweep(owner, seeds="0", overrides=["num_steps=7"])
    (other.run_dir(other.cells[0], 0)).mkdir(parents=True)
    runner._launch(other, other.cells[0], 0).process.wait()  # writes its identity
    with pytest.raises(UserError, match=f"baseline_from {owner} lr=0.002: .* another setting"):
        run_sweep(config, progress=False, report_only=True)


def test_baseline_from_is_refused_when_it_cannot_be_a_fair_baseline(tmp_path):
    owner = _sweep_file(tmp_path / "owner.yaml", out=str(tmp_path / "o"), grid={"lr": [0.002]})
    good = {"sweep": str(owner), "cell": {"lr": 0.002}, "label": "shared"}

    def config(**values):
        values = {"command": "demo", **values}
        return load_sweep(None, out=str(tmp_path / "s"), grid="lr=0.001", **values)

    assert config(baseline_from=good).baseline_cell.name == "lr=shared"
    cases = [
        ({**good, "sweep": "nowhere.yaml"}, r"baseline_from.sweep='nowhere.yaml' is not a file"),
        ({**good, "cell": {"lr": 0.5}}, r"baseline_from.cell \{'lr': '0.5'\} names no cell"),
        ({**good, "cell": "lr"}, r"baseline_from.cell 'lr' must look like axis=value"),
        ({**good, "label": "0.001"}, r"label='0.001' must be a new value of the first axis"),
        ({"sweep": str(owner), "cell": {"lr": 0.002}}, "exactly the keys"),
    ]
    for spec, message in cases:
        with pytest.raises(UserError, match=message):
            config(baseline_from=spec)
    with pytest.raises(UserError, match="names both baseline"):
        config(baseline_from=good, baseline="lr=0.001")
    with pytest.raises(UserError, match="scores its runs by 'eval_reward_after'"):
        config(baseline_from=good, score="test_after")
    with pytest.raises(UserError, match="runs `mmgrpo demo` and this sweep `mmgrpo train`"):
        config(baseline_from=good, command="train")
    chained = _sweep_file(
        tmp_path / "chained.yaml", out=str(tmp_path / "c"), grid={"lr": [0.003]}, baseline_from=good
    )
    with pytest.raises(UserError, match="takes its own baseline from"):
        config(baseline_from={**good, "sweep": str(chained), "cell": {"lr": 0.003}})
    itself = tmp_path / "itself.yaml"  # a file naming itself: refused, not built forever
    _sweep_file(itself, out=str(tmp_path / "i"), grid={"lr": [0.003]}, baseline_from=good)
    _sweep_file(
        itself,
        out=str(tmp_path / "i"),
        grid={"lr": [0.003]},
        baseline_from={**good, "sweep": str(itself)},
    )
    with pytest.raises(UserError, match="takes its own baseline from"):
        load_sweep(itself)
    # the command line's baseline replaces the file's baseline_from
    assert load_sweep(chained, baseline="lr=0.003").baseline_from is None


@pytest.mark.slow  # two sweeps of real processes, one killed (~40 s)
def test_a_baseline_from_sweep_killed_mid_run_ends_with_the_table_of_an_uninterrupted_one(
    tmp_path, fake_runs
):
    """kill -9 of a sweep whose baseline row comes from another sweep, mid-way through its own
    runs; started again it resumes the killed run and writes the uninterrupted sweep's table,
    the baseline row (read from the other sweep, never run here) once."""
    owner = _sweep_file(tmp_path / "owner.yaml", out=str(tmp_path / "owner"), grid={"lr": [0.002]})
    run_sweep(load_sweep(owner), progress=False)
    reference = {"sweep": str(owner), "cell": {"lr": 0.002}, "label": "shared"}
    grid = {"lr": [0.001, 0.004]}
    files = {
        name: _sweep_file(
            tmp_path / f"{name}.yaml",
            out=str(tmp_path / name),
            grid=grid,
            overrides=["num_steps=8"],
            baseline_from=reference,
        )
        for name in ("clean", "killed")
    }
    env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_STEP_SECONDS": "0.3"}

    def sweep(name):
        command = [sys.executable, str(REPO / "tests" / "sweep" / "fake_sweep.py"), "sweep"]
        return subprocess.Popen(
            [*command, "--sweep", str(files[name])], env=env, stderr=subprocess.PIPE, text=True
        )

    clean, killed = sweep("clean"), sweep("killed")
    checkpoint = tmp_path / "killed" / "runs" / "lr-0.004" / "seed1" / "ckpt.json"
    deadline = time.monotonic() + 120
    while not checkpoint.is_file() or json.loads(checkpoint.read_text())["step"] < 3:
        assert time.monotonic() < deadline and killed.poll() is None
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    deadline = time.monotonic() + 30
    while True:  # the orphaned run gets SIGTERM from the kernel and exits
        try:
            with RunLock(checkpoint.parent):
                break
        except UserError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    again = sweep("killed")
    for process in (again, clean):
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
    for name in ("table.csv", "runs.csv"):
        done = _without_wall_time((tmp_path / "killed" / name).read_text())
        assert done == _without_wall_time((tmp_path / "clean" / name).read_text())
    table = list(csv.DictReader((tmp_path / "killed" / "table.csv").open()))
    assert [(r["lr"], r["runs"]) for r in table] == [
        ("shared", "3"),
        ("0.001", "3"),
        ("0.004", "3"),
    ]
    assert not (tmp_path / "killed" / "runs" / "lr-shared").exists()
    assert (checkpoint.parent / runner.LOG).read_text().count("=== ") == 2  # resumed


def _search_once(out: Path, **values):
    """Table 1's prompt cells: `together` (listed first) loads `prompt_opt`'s search."""
    from models.tiny_checkpoint import write_tiny_checkpoint

    tiny = out.parent / "tiny"
    if not tiny.is_dir():
        write_tiny_checkpoint(tiny)
    grid = {
        "method": {
            "together": {"strategy": "p -> w"},
            "prompt_opt": {"strategy": "p"},
            "mmgrpo": {"strategy": "w"},
        }
    }
    settings = {
        "command": "better-together",
        "out": str(out),
        "grid": grid,
        "seeds": "0-1",
        "jobs": 2,
        "overrides": ["task.name=capitals", f"mmgrpo.model_path={tiny}"],
        "prompt_stage_from": {"together": "prompt_opt"},
    }
    return load_sweep(None, **{**settings, **values})


def test_a_better_together_cell_waits_for_its_search_and_loads_it(
    tmp_path, fake_runs, monkeypatch, caplog
):
    def second_search_fails(config, cell, seed):
        line = fake_command_line(config, cell, seed)
        return [*line, "fail=3"] if (cell.name, seed) == ("method=prompt_opt", 1) else line

    monkeypatch.setattr(runner, "command_line", second_search_fails)
    config = _search_once(tmp_path / "sweep")
    together, searched = config.cells[0], config.cells[1]
    assert config.prompt_source(together) == searched and config.prompt_source(searched) is None
    with caplog.at_level("WARNING"):
        report = run_sweep(config, progress=False)
    assert [(f.cell, f.seed) for f in report.failures] == [(searched, 1)]
    summary = json.loads((config.run_dir(together, 0) / "summary.json").read_text())
    prompts = config.run_dir(searched, 0) / "prompts" / "prompt_state.json"
    # jobs=2 and listed first, yet it waited: the search had saved its prompts when it started
    assert summary["prompt_stage"] == str(prompts)
    assert summary["loaded"] == json.loads(prompts.read_text())
    # the search of seed 1 failed: that seed's run searches itself, and the log says so
    again = json.loads((config.run_dir(together, 1) / "summary.json").read_text())
    assert again["prompt_stage"] is None and "loaded" not in again
    assert "method=together seed 1 searches its own prompt stage" in caplog.text
    # the loaded file is not part of what makes the run: a restart finds it the same run
    identity = json.loads((config.run_dir(together, 0) / runner.IDENTITY).read_text())
    assert identity["config"]["prompt_stage"] is None
    assert run_sweep(config, progress=False).skipped == 5


def test_cells_wait_for_the_program_as_written_and_read_its_start_scores(
    tmp_path, fake_runs, monkeypatch, caplog
):
    def second_vanilla_fails(config, cell, seed):
        line = fake_command_line(config, cell, seed)
        return [*line, "fail=3"] if (cell.name, seed) == ("method=vanilla", 1) else line

    monkeypatch.setattr(runner, "command_line", second_vanilla_fails)
    grid = {
        "method": {
            "together": {"strategy": "p -> w"},
            "trajectory": {"strategy": "w", "mmgrpo.grouping": "trajectory"},
            "prompt_opt": {"strategy": "p"},
            "vanilla": {"strategy": "none"},
        }
    }
    config = _search_once(tmp_path / "sweep", grid=grid, start_scores_from="vanilla")
    together, trajectory, searched, vanilla = config.cells
    assert config.start_source(trajectory) == vanilla and config.start_source(vanilla) is None
    with caplog.at_level("WARNING"):
        report = run_sweep(config, progress=False)
    assert [(f.cell, f.seed) for f in report.failures] == [(vanilla, 1)]
    written = config.run_dir(vanilla, 0) / "summary.json"
    for cell in (together, trajectory, searched):  # listed before it with jobs=2, yet they waited
        summary = json.loads((config.run_dir(cell, 0) / "summary.json").read_text())
        assert summary["start_scores"] == str(written)
        assert summary["stages"] == json.loads(written.read_text())["stages"]
        # seed 1's program as written failed: those runs score their start themselves
        again = json.loads((config.run_dir(cell, 1) / "summary.json").read_text())
        assert "start_scores" not in again and again["stages"][0]["valset"] == 1.1
    assert "method=trajectory seed 1 scores its own start stage" in caplog.text
    identity = json.loads((config.run_dir(trajectory, 0) / runner.IDENTITY).read_text())
    assert identity["config"]["start_scores"] is None  # a restart finds it the same run
    assert run_sweep(config, progress=False).skipped == 7


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        (
            {"vanilla": {"strategy": "w"}, "mmgrpo": {"strategy": "w"}},
            "method=vanilla runs strategy='w', not 'none'",
        ),
        (
            {"vanilla": {"strategy": "none"}, "again": {"strategy": "none"}},
            "method=again runs strategy='none' too",
        ),
        (
            {"vanilla": {"strategy": "none"}, "mmgrpo": {"strategy": "w", "test_limit": 1}},
            r"differ in test_limit: None -> 1; the start stage would not be the same",
        ),
    ],
)
def test_start_scores_must_be_those_the_cell_would_score(tmp_path, fake_runs, grid, message):
    config = _search_once(
        tmp_path / "sweep", grid={"method": grid}, start_scores_from="vanilla", prompt_stage_from={}
    )
    with pytest.raises(UserError, match=message):
        run_sweep(config, progress=False)
    assert not (tmp_path / "sweep" / "runs").exists()  # refused before any run
    with pytest.raises(UserError, match=r"'nowhere' is not a value of the first axis"):
        _search_once(tmp_path / "other", start_scores_from="nowhere")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"command": "demo", "grid": GRID, "overrides": []}, "only better-together runs"),
        ({"prompt_stage_from": {"together": "nowhere"}}, "'nowhere' is not a value of"),
        ({"prompt_stage_from": {"together": "together"}}, "loads its own prompt stage"),
        (
            {"prompt_stage_from": {"together": "prompt_opt", "prompt_opt": "mmgrpo"}},
            "'prompt_opt' loads its own prompt stage",
        ),
    ],
)
def test_prompt_stage_from_names_values_of_the_first_axis(tmp_path, values, message):
    with pytest.raises(UserError, match=message):
        _search_once(tmp_path / "sweep", **values)


@pytest.mark.parametrize(
    ("together", "message"),
    [
        ({"strategy": "w"}, "runs strategy='w'; a loaded stage stands for"),
        (
            {"strategy": "p -> w", "mmgrpo.num_steps": 3},
            r"differ in mmgrpo.num_steps: 100 -> 3; the search would not be the same",
        ),
    ],
)
def test_a_loaded_search_must_be_the_one_the_cell_would_run(tmp_path, fake_runs, together, message):
    grid = {"method": {"together": together, "prompt_opt": {"strategy": "p"}}}
    config = _search_once(tmp_path / "sweep", grid=grid)
    with pytest.raises(UserError, match=message):
        run_sweep(config, progress=False)
    assert not (tmp_path / "sweep" / "runs").exists()  # refused before any run
    wrong = {"method": {"together": {"strategy": "p -> w"}, "prompt_opt": {"strategy": "w"}}}
    with pytest.raises(UserError, match="method=prompt_opt runs strategy='w', not 'p'"):
        run_sweep(_search_once(tmp_path / "other", grid=wrong), progress=False)
