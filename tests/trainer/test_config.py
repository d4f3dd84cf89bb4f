import dataclasses
import json

import pytest

from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.trainer.config import (
    DistributedConfig,
    MemoryConfig,
    MMGRPOConfig,
    OptimConfig,
    ParallelConfig,
    SamplerConfig,
    changed_keys,
    computes_the_same,
    field_defaults,
    flatten,
)


def test_dr_grpo_normalises_by_the_samplers_completion_limit():
    cfg = MMGRPOConfig(loss=LossConfig("dr_grpo"), sampler=SamplerConfig(max_completion_tokens=96))
    assert cfg.resolved_loss.max_completion_length == 96
    assert cfg.loss.max_completion_length is None  # the config keeps what was written
    same = LossConfig("dr_grpo", max_completion_length=96)
    resolved = MMGRPOConfig(loss=same, sampler=SamplerConfig(max_completion_tokens=96))
    assert resolved.resolved_loss == same
    with pytest.raises(ValueError, match=r"max_completion_length=64 differs from .*=96"):
        MMGRPOConfig(
            loss=LossConfig("dr_grpo", max_completion_length=64),
            sampler=SamplerConfig(max_completion_tokens=96),
        )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SamplerConfig(temperature=0.0), r"SamplerConfig.temperature must be > 0"),
        (lambda: SamplerConfig(top_p=1.5), r"SamplerConfig.top_p must be in \(0, 1\], got 1.5"),
        (lambda: SamplerConfig(max_prompt_tokens=0), "max_prompt_tokens must be >= 1 or null"),
        (lambda: SamplerConfig(max_completion_tokens=0), "max_completion_tokens must be >= 1"),
        (lambda: SamplerConfig(batch=0), "SamplerConfig.batch must be >= 1, got 0"),
        (lambda: SamplerConfig(max_wait_s=0.0), "max_wait_s must be > 0"),
        (lambda: OptimConfig(lr=0.0), "OptimConfig.lr must be > 0, got 0.0"),
        (lambda: OptimConfig(decay="step"), "decay must be constant, linear or cosine"),
        (lambda: MMGRPOConfig(align="fill"), "MMGRPOConfig.align must be one of"),
        (lambda: MMGRPOConfig(select_k=1), "select_k must be >= 2 or null, got 1"),
        (lambda: MMGRPOConfig(advantage_scale="rank"), "advantage_scale must be a registered"),
        (lambda: MMGRPOConfig(seed=2**32), r"seed must be in \[0, 2\*\*32\)"),
        (lambda: ParallelConfig(fsdp=0), "ParallelConfig.fsdp must be >= 1, got 0"),
        (
            lambda: MemoryConfig(pack=False),
            "MemoryConfig.share_prompts needs packed rows: with pack false .* set share_prompts "
            "false too, got True",
        ),
        (
            lambda: MemoryConfig(pack=False, share_prompts=False, pack_length=64),
            "MemoryConfig.pack_length caps packed sequences: it needs pack true, got 64",
        ),
        (
            lambda: MemoryConfig(pack_length=-1),
            r"MemoryConfig.pack_length must be >= 0 \(0 = chosen from the step's rows\)",
        ),
        (
            lambda: MemoryConfig("pallas"),
            "MemoryConfig.share_prompts needs attention 'dense' or 'blockwise'",
        ),
        (lambda: ParallelConfig(devices=0), "ParallelConfig.devices must be >= 1 or null"),
        (
            lambda: DistributedConfig(num_processes=2),
            "DistributedConfig.coordinator_address must be host:port when num_processes > 1",
        ),
        (
            lambda: DistributedConfig("127.0.0.1", num_processes=2),
            r"coordinator_address must be host:port, e.g. 10.0.0.1:1234, got '127.0.0.1'",
        ),
        (
            lambda: DistributedConfig("127.0.0.1:99999", num_processes=2),
            r"coordinator_address must have a port in 1-65535, got '127.0.0.1:99999'",
        ),
        (
            lambda: DistributedConfig(":1234", num_processes=2),
            r"coordinator_address must be host:port",
        ),
        (
            lambda: DistributedConfig("h:0x10", num_processes=2),
            r"must have a port in 1-65535, got 'h:0x10'",
        ),
        (
            lambda: DistributedConfig("h:1", num_processes=2, process_id=2),
            r"process_id must be in \[0, num_processes=2\), got 2",
        ),
    ],
)
def test_every_section_names_its_bad_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_shared_prompts_refuse_lora_dropout_whose_draw_they_would_share():
    from models.lora import LoRAConfig

    with pytest.raises(ValueError, match=r"share_prompts with lora.dropout=0.05: a shared prefix"):
        MMGRPOConfig(lora=LoRAConfig(dropout=0.05))  # the default memory: shared
    MMGRPOConfig(lora=LoRAConfig(dropout=0.05), memory=MemoryConfig(share_prompts=False))


def test_coordinator_addresses_as_users_write_them():
    for address, port in [("127.0.0.1:1234", 1234), ("node-3:65535", 65535), ("[::1]:8476", 8476)]:
        assert DistributedConfig(address, num_processes=2).coordinator_port == port


def test_a_field_added_at_its_default_is_no_change_to_an_older_record():
    """A checkpoint or sweep folder written before a config field existed still resumes, unless
    the new field is set away from its default."""
    defaults = field_defaults(MMGRPOConfig)
    assert defaults["loss.variant"] == "grpo" and defaults["sampler.temperature"] == 1.0
    now = flatten(json.loads(json.dumps(dataclasses.asdict(MMGRPOConfig()))))
    older = {k: v for k, v in now.items() if k != "loss.sapo_tau_pos"}  # before the field
    assert changed_keys(older, now) == ["loss.sapo_tau_pos"]  # without defaults: a change
    assert changed_keys(older, now, defaults) == []
    moved = {**now, "loss.sapo_tau_pos": 2.0}
    assert changed_keys(older, moved, defaults) == ["loss.sapo_tau_pos"]
    assert changed_keys({**older, "loss.gone": 1}, now, defaults) == ["loss.gone"]


@pytest.mark.parametrize("prefix", ["", "mmgrpo."])  # train's settings, better-together's
def test_how_a_run_is_computed_is_not_what_it_computes(prefix):
    """A sweep reuses a finished run whose settings differ only in memory layout, mesh or
    micro-batch size; bnpo (a mean of micro-batch means) and LoRA dropout (a draw per
    micro-batch) make the micro-batch size part of what is computed."""
    now = {f"{prefix}{k}": v for k, v in flatten(dataclasses.asdict(MMGRPOConfig())).items()}
    key = f"{prefix}optim.micro_batch_size"
    older = {**now, key: 8, f"{prefix}memory.logits_chunk": 0}
    newer = {**now, key: 4, f"{prefix}memory.logits_chunk": 256}
    assert sorted(changed_keys(older, newer)) == sorted([key, f"{prefix}memory.logits_chunk"])
    assert all(computes_the_same(k, older, newer) for k in changed_keys(older, newer))
    for what in ({"loss.variant": "bnpo"}, {"lora.dropout": 0.1}):
        setting = {f"{prefix}{k}": v for k, v in what.items()}
        assert not computes_the_same(key, {**older, **setting}, newer)
        assert not computes_the_same(key, older, {**newer, **setting})
    for key in ("optim.lr", "sampler.max_prompt_tokens", "num_steps", "loss.variant"):
        assert not computes_the_same(f"{prefix}{key}", older, newer)


def test_packed_rows_need_a_prompt_bound_so_no_row_can_outgrow_them_after_rollouts(capsys):
    """pack_length without sampler.max_prompt_tokens: any prompt up to the model's limit could
    be sampled and then not fit a pack (it was a traceback after the first step's rollouts)."""
    with pytest.raises(
        ValueError,
        match=r"pack_length=64 needs a bound on the rows it packs: "
        r"set sampler.max_prompt_tokens \(at most .* = 48\)",
    ):
        MMGRPOConfig(
            memory=MemoryConfig(pack_length=64), sampler=SamplerConfig(max_completion_tokens=16)
        )
    with pytest.raises(ValueError, match=r"pack_length=64 is shorter than the longest row"):
        MMGRPOConfig(
            memory=MemoryConfig(pack_length=64),
            sampler=SamplerConfig(max_prompt_tokens=49, max_completion_tokens=16),
        )
    MMGRPOConfig(
        memory=MemoryConfig(pack_length=64),
        sampler=SamplerConfig(max_prompt_tokens=48, max_completion_tokens=16),
    )
    from mmgrpo_jax import cli

    argv = ["train", "task.name=capitals", "mmgrpo.memory.pack_length=64"]
    assert cli.main(argv) == 2  # when the config is read: before a model or a rollout
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "needs a bound on the rows it packs" in err
