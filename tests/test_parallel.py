"""The mesh from the config (docs/design.md#scale): sharded training equals one device."""

import json
import logging
import os
import signal
import socket
import threading

import jax
import numpy as np
import pytest

from mmgrpo_jax import parallel
from mmgrpo_jax.rl.batch import PackShape, Row, pack_rows
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.testing import tiny_decoder
from mmgrpo_jax.trainer.config import (
    DistributedConfig,
    MemoryConfig,
    MMGRPOConfig,
    OptimConfig,
    ParallelConfig,
    SamplerConfig,
)
from mmgrpo_jax.trainer.interrupt import Interrupted, StopSignals
from models.lora import LoRAConfig
from models.sharding import batch_multiple
from models.tokenizer import train_bpe_tokenizer
from tests.cli.test_distributed import free_port
from tests.trainer.conftest import CORPUS
from tests.trainer.test_mmgrpo import run


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer(CORPUS, 300, "chatml")


MESHES = {
    "one_device": ParallelConfig(data=1, devices=1),
    "data8": ParallelConfig(),  # the default: every device on data
    "data2_fsdp2_tensor2": ParallelConfig(data=2, fsdp=2, tensor=2),
}


def losses(tokenizer, tmp_path, name, train, grouping, memory=None):
    lora = LoRAConfig(rank=2, alpha=4.0) if train == "lora" else None
    model = tiny_decoder(len(tokenizer), hidden_size=64, lora=lora, seed=1)
    cfg = MMGRPOConfig(
        grouping=grouping,
        train=train,
        num_rollouts=3,
        examples_per_step=2,
        num_steps=3,
        sampler=SamplerConfig(max_prompt_tokens=240, max_completion_tokens=4, max_wait_s=10.0),
        # full training at the default rate: at 1e-3 the first step still agrees to 1e-7 but
        # Adam turns reduction-order noise into full-size steps (grad_norm of step 3 then
        # differs by 2e-4 between one device and eight)
        optim=OptimConfig(lr=5e-2 if train == "lora" else 1e-5, micro_batch_size=8),
        loss=LossConfig("grpo", beta=0.04),
        parallel=MESHES[name],
        memory=memory or MemoryConfig(),
        eval_every=100,
        checkpoint_every=100,
        run_dir=str(tmp_path / name),
        progress=False,
    )
    run(tokenizer, cfg, model)
    if memory is not None and memory.share_prompts:  # the rows did share their prompts
        shares = [r["forward_token_share"] for r in _metric_rows(tmp_path / name) if "loss" in r]
        assert shares and max(shares) < 1.0, shares
    steps = [r for r in _metric_rows(tmp_path / name) if "loss" in r]
    return {k: [r[k] for r in steps] for k in ("loss", "grad_norm", "reward_mean", "kl_mean")}


@pytest.mark.parametrize(
    ("train", "grouping"),
    [
        # ~90 s and ~100 s: make test-slow; make test keeps LoRA's sharded step on the 3-axis
        # mesh in test_shared_prompts_on_a_mesh_match_one_device
        pytest.param("lora", "module", id="lora_module", marks=pytest.mark.slow),
        pytest.param("full", "trajectory", id="full_trajectory", marks=pytest.mark.slow),
    ],
)
def test_sharded_training_matches_one_device(tokenizer, tmp_path, train, grouping):
    want = losses(tokenizer, tmp_path, "one_device", train, grouping)
    assert len(want["loss"]) == 3 and max(map(abs, want["loss"])) > 0
    for name in ("data8", "data2_fsdp2_tensor2"):
        got = losses(tokenizer, tmp_path, name, train, grouping)
        assert got["reward_mean"] == want["reward_mean"], name  # the same samples
        for key in ("loss", "grad_norm", "kl_mean"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=name)


def _metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def test_shared_prompts_on_a_mesh_match_one_device(tokenizer, tmp_path):
    """A shared prompt's completions gather its hidden states across the packed sequence and
    the targets scatter back to rows: with the sequences split over data and fsdp and the
    weights over tensor, the step must still equal one device's (tests/rl/test_step.py holds
    it equal to the rows packed apart)."""
    shared = MemoryConfig(pack_length=256, share_prompts=True)
    want = losses(tokenizer, tmp_path, "one_device", "lora", "module", shared)
    assert len(want["loss"]) == 3 and max(map(abs, want["loss"])) > 0
    got = losses(tokenizer, tmp_path, "data2_fsdp2_tensor2", "lora", "module", shared)
    assert got["reward_mean"] == want["reward_mean"]  # the same samples
    for key in ("loss", "grad_norm", "kl_mean"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("train", "grouping"),
    [("lora", "trajectory"), ("full", "module")],
    ids=["lora_trajectory", "full_module"],
)
def test_sharded_training_matches_one_device_other_pairs(tokenizer, tmp_path, train, grouping):
    test_sharded_training_matches_one_device(tokenizer, tmp_path, train, grouping)


def test_the_mesh_follows_the_config():
    assert parallel.run_mesh(ParallelConfig()).shape == {"data": 8, "fsdp": 1, "tensor": 1}
    mesh = parallel.run_mesh(ParallelConfig(data=None, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert batch_multiple(mesh) == 4
    assert parallel.run_mesh(ParallelConfig(devices=2)).devices.size == 2
    with pytest.raises(ValueError, match=r"data=3 x fsdp=1 x tensor=1 does not cover the 8"):
        parallel.run_mesh(ParallelConfig(data=3))
    with pytest.raises(ValueError, match=r"devices=16, but this host has 8"):
        parallel.run_mesh(ParallelConfig(devices=16))
    with pytest.raises(ValueError, match=r"micro_batch_size=6 does not split over .* = 4"):
        MMGRPOConfig(optim=OptimConfig(micro_batch_size=6), parallel=ParallelConfig(data=2, fsdp=2))


def test_a_batch_splits_its_rows_over_data_and_fsdp():
    rows = [Row((1, 2, 3), (4, 5), advantage=1.0, unit=k) for k in range(3)]
    mesh = parallel.run_mesh(ParallelConfig(data=2, fsdp=2, tensor=2))
    packed = pack_rows(rows, micro_batch_size=4, pack=PackShape(4, 16), row_multiple=4)
    assert packed.advantages.shape[1] % 4 == 0
    placed = parallel.place_batch(packed, mesh)
    assert placed.tokens.sharding.spec == jax.sharding.PartitionSpec(None, ("data", "fsdp"))
    assert placed.num_tokens.sharding.is_fully_replicated
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(placed), jax.device_get(packed))
    with pytest.raises(ValueError, match=r"micro_batch_size=6 does not split over 4 devices"):
        pack_rows(rows, micro_batch_size=6, row_multiple=4)


def test_shares_cover_every_example_once():
    items = list(range(7))
    shares = [parallel.share(items, p, 3) for p in range(3)]
    assert [list(s) for s in shares] == [[0, 1, 2], [3, 4], [5, 6]]
    assert parallel.gather_lists([{"a": 1}, 2]) == [{"a": 1}, 2]


# ---------------------------------------------------------------- joining the other processes


@pytest.fixture
def blocked_join(monkeypatch):
    """The runtime's join as a peer that never comes leaves it: blocked (released at the end)."""
    release = threading.Event()
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: release.wait())
    monkeypatch.setattr(parallel, "JOIN_REPORT_EVERY_S", 0.2)
    yield
    release.set()


def lone(process_id, num_processes, timeout_s=1, port=None):
    address = f"127.0.0.1:{port or free_port()}"
    return DistributedConfig(address, num_processes, process_id, initialization_timeout_s=timeout_s)


def test_a_lone_process_says_how_long_it_waited_and_who_never_joined(blocked_join, caplog):
    config = lone(0, 2)
    with caplog.at_level(logging.WARNING), pytest.raises(parallel.JoinTimeout) as caught:
        parallel.initialize(config)
    assert str(caught.value) == (
        f"distributed: process 1 never joined within 1 s at {config.coordinator_address} (this "
        "is process 0 of 2); start every process with the same coordinator_address and "
        "num_processes and its own process_id, or raise distributed.initialization_timeout_s"
    )
    waits = [r.getMessage() for r in caplog.records if "waiting for the 2 processes" in r.message]
    assert len(waits) >= 3 and "(this is process 0; this process hosts the coordinator)" in waits[0]
    assert parallel.join_abandoned()


def test_a_process_without_its_coordinator_names_it_and_sees_it_come_up(blocked_join, caplog):
    port = free_port()
    with pytest.raises(
        parallel.JoinTimeout,
        match=r"^distributed: process 0 \(the coordinator\) "
        r"never came up; of processes \[2\] the runtime cannot say within 1 s",
    ):
        parallel.initialize(lone(1, 3, port=port))
    up = pytest.raises(parallel.JoinTimeout, match=r"some of processes \[2\] never joined")
    with socket.create_server(("127.0.0.1", port)), caplog.at_level(logging.WARNING), up:
        parallel.initialize(lone(1, 3, port=port))
    assert "the coordinator (process 0) is up" in caplog.text


def test_a_signal_while_waiting_stops_the_wait_saying_nothing_started(blocked_join):
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    with StopSignals(), pytest.raises(Interrupted) as caught:
        parallel.initialize(lone(0, 2, timeout_s=60))
    assert caught.value.exit_code == 143
    assert "while waiting for the 2 processes of the run to join" in caught.value.__notes__[0]
