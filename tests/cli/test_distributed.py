"""Multi-host (docs/design.md#scale): `mmgrpo demo` as 2 processes x 4 devices trains like 1 x 8.

Real processes on 127.0.0.1, each with its own fake CPU devices, joined by jax.distributed.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

DEMO = ["num_steps=6", "examples_per_step=4", "num_rollouts=4", "progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def demo(run_dir, *args, devices: int, log) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    command = [sys.executable, "-m", "mmgrpo_jax.cli", "demo", *DEMO, f"run_dir={run_dir}", *args]
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def two_processes(run_dir, *args, logs) -> list[subprocess.Popen]:
    join = [
        f"distributed.coordinator_address=127.0.0.1:{free_port()}",
        "distributed.num_processes=2",
        *args,
    ]
    return [
        demo(run_dir, *join, f"distributed.process_id={i}", devices=4, log=logs[i])
        for i in range(2)
    ]


def finish(processes, logs, timeout=600) -> None:
    for p, log in zip(processes, logs, strict=True):
        assert p.wait(timeout=timeout) == 0, f"{log}:\n{log.read_text()[-3000:]}"


def steps(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in rows if "loss" in r]


@pytest.mark.slow  # two training processes end to end (~75 s); make test keeps the death test
def test_two_processes_train_like_one(tmp_path):
    """6 steps of 1 process x 8 devices against 2 x 4: the same rewards at every step (the same
    samples: per-request keys) and losses within 1e-4."""
    logs = [tmp_path / f"log{i}.txt" for i in range(3)]
    runs = [demo(tmp_path / "one", devices=8, log=logs[2])]
    runs += two_processes(tmp_path / "two", logs=logs[:2])
    finish(runs, [logs[2], *logs[:2]])
    want, got = steps(tmp_path / "one"), steps(tmp_path / "two")
    assert [r["step"] for r in got] == [float(s) for s in range(1, 7)]
    assert [r["reward_mean"] for r in got] == [r["reward_mean"] for r in want]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], atol=1e-4)
    assert max(abs(r["loss"]) for r in want) > 0
    assert (tmp_path / "two" / "adapter").exists() is False  # full training: no adapter
    assert (tmp_path / "two" / "summary.json").is_file()


@pytest.mark.slow
def test_every_process_restores_the_checkpoint(tmp_path):
    """3 steps as 2 processes, then resumed to 6 (num_steps grows, as a user extends a run):
    both processes restore step 3 and the run ends at 6 with one log of every step."""
    logs = [tmp_path / f"log{i}.txt" for i in range(2)]
    finish(two_processes(tmp_path / "run", "num_steps=3", logs=logs), logs)
    assert (tmp_path / "run" / "checkpoints" / "3").is_dir()
    finish(two_processes(tmp_path / "run", "resume=true", logs=logs), logs)
    assert [r["step"] for r in steps(tmp_path / "run")] == [float(s) for s in range(1, 7)]
    assert (tmp_path / "run" / "checkpoints" / "6").is_dir()


def test_a_process_that_dies_stops_the_other_with_an_error(tmp_path):
    """Process 1 is killed once process 0 trains; process 0 must exit with an error within the
    heartbeat timeout (plus start-up slack), not wait in a collective for ever."""
    logs = [tmp_path / f"log{i}.txt" for i in range(2)]
    survivor, victim = two_processes(
        tmp_path / "run", "num_steps=50", "distributed.heartbeat_timeout_s=5", logs=logs
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "run" / "metrics.jsonl").exists():  # both joined and compiled
        assert time.monotonic() < deadline and survivor.poll() is None
        time.sleep(0.5)
    victim.kill()
    killed = time.monotonic()
    try:
        code = survivor.wait(timeout=90)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail("process 0 still runs 90 s after process 1 died")
    assert code != 0
    assert time.monotonic() - killed < 90
    text = logs[0].read_text()
    assert "stopped sending heartbeats" in text or "unhealthy" in text, text[-2000:]


@pytest.mark.slow
def test_a_signal_to_one_process_stops_every_process_at_the_same_step(tmp_path):
    """SIGTERM to process 1 only: both stop at the next step boundary together, write one
    checkpoint of the last completed step, and exit 143 (no process waits in a collective)."""
    import signal

    logs = [tmp_path / f"log{i}.txt" for i in range(2)]
    processes = two_processes(tmp_path / "run", "num_steps=50", logs=logs)
    deadline = time.monotonic() + 300
    while not any('"step": 2.0' in line for line in _lines(tmp_path / "run" / "metrics.jsonl")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in processes)
        time.sleep(0.5)
    processes[1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=120) for p in processes]
    assert codes == [143, 143], [log.read_text()[-2000:] for log in logs]
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved and saved[-1] == int(steps(tmp_path / "run")[-1]["step"])


def _lines(path):
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
def test_a_lone_process_reports_its_wait_and_stops_on_time_or_on_a_signal(tmp_path):
    """The real runtime with no second process: a progress line, then at the timeout one line
    naming the process that never joined (exit 2, no abort, no run_dir); a SIGTERM while
    waiting exits 143 at once."""
    lone = [
        "distributed.num_processes=2",
        "distributed.process_id=0",
        "distributed.initialization_timeout_s=12",
    ]
    run_dir, log = tmp_path / "run", tmp_path / "log.txt"
    port = free_port()
    started = time.monotonic()
    p = demo(
        run_dir, *lone, f"distributed.coordinator_address=127.0.0.1:{port}", devices=1, log=log
    )
    assert p.wait(timeout=60) == 2, log.read_text()[-3000:]
    assert time.monotonic() - started < 40
    lines = log.read_text().strip().splitlines()
    assert "waiting for the 2 processes of the run" in lines[0]
    assert lines[-1].startswith("mmgrpo demo: distributed: process 1 never joined within 12 s")
    assert not any("Traceback" in x or "Check failure" in x for x in lines)
    assert not run_dir.exists()

    p = demo(
        run_dir,
        *lone,
        f"distributed.coordinator_address=127.0.0.1:{free_port()}",
        devices=1,
        log=log,
    )
    time.sleep(6)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 143
    assert "stopped by SIGTERM; while waiting for the 2 processes" in log.read_text()
