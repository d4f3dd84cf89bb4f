import dataclasses
import json

import pytest

from mmgrpo_jax import cli
from mmgrpo_jax.commands.plan import CPU_PLAN_OPTIONS
from mmgrpo_jax.errors import UserError
from mmgrpo_jax.trainer.config import MemoryConfig, MMGRPOConfig, OptimConfig, SamplerConfig
from mmgrpo_jax.trainer.plan import check_fits, plan_memory
from models.config import ModelConfig
from models.lora import LoRAConfig

MODEL = ModelConfig.tiny(512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
LEAN = MemoryConfig("blockwise", attention_block=128, remat=True, logits_chunk=128)


def config(memory=None, micro_batch=4, sampler_batch=6, prompt=896, completion=128):
    return MMGRPOConfig(
        dtype="float32",
        memory=memory or MemoryConfig(),
        optim=OptimConfig(micro_batch_size=micro_batch),
        sampler=SamplerConfig(
            max_prompt_tokens=prompt, max_completion_tokens=completion, batch=sampler_batch
        ),
        progress=False,
    )


def test_the_plan_counts_weights_cache_and_both_phases():
    plan = plan_memory(config(), MODEL, device_bytes=10**12, memory_fraction=0.5)
    lora = 2 * 16 * 1024  # 2 layers x rank 16 x (in + out) summed over the 7 projections
    assert plan.weights_bytes == (MODEL.num_params() + lora) * 4
    # 6 requests pad to 8 rows; 896 prompt tokens + 128 decode steps fill 1,024 slots: float32
    # keys and values of every layer
    layers, kv, dh, slots = MODEL.num_layers, MODEL.num_kv_heads, MODEL.head_dim, 896 + 128
    assert plan.kv_cache_bytes == 2 * layers * 8 * kv * dh * slots * 4
    want = "8 requests x 1024 cache slots (1024-token prefill passes)"
    assert plan.shapes["sampler batch"] == want
    assert plan.sampler_bytes >= plan.weights_bytes + plan.kv_cache_bytes
    assert plan.train_step_bytes >= plan.weights_bytes + plan.train_temp_bytes
    assert plan.usable_bytes == 5 * 10**11 and plan.fits
    assert plan.peak_bytes == max(plan.train_step_bytes, plan.sampler_bytes)
    out = plan.to_json()
    assert {"train_step_bytes", "sampler_bytes", "device_bytes", "fits"} <= set(out)
    assert "| fits | yes |" in plan.table()


def test_per_module_adapters_are_planned_with_their_stacked_weights_and_mixed_batches():
    """Two adapters: twice the LoRA weights, and the train step and sampler compiled with the
    per-row adapter ids they run with (a plan of the one-adapter call would fail to trace)."""
    modules = LoRAConfig(rank=16, alpha=32.0, modules=("a*=a", "*=b"))
    one = plan_memory(config(), MODEL, device_bytes=10**12)
    two = plan_memory(dataclasses.replace(config(), lora=modules), MODEL, device_bytes=10**12)
    lora = 2 * 16 * 1024
    assert two.weights_bytes - one.weights_bytes == lora * 4
    assert two.train_step_bytes > one.train_step_bytes and two.fits


@pytest.mark.slow  # nine compiles, ~30 s: the paper configs' plans show the same effect at 8B
def test_the_memory_settings_shrink_the_train_step():
    """Dense float32 scores of 4 rows x 512 tokens dominate the reference step."""
    dense = plan_memory(config(prompt=384), MODEL, 10**12)
    lean = plan_memory(config(memory=LEAN, prompt=384), MODEL, 10**12)
    assert lean.train_temp_bytes < 0.5 * dense.train_temp_bytes
    chunked = plan_memory(
        config(memory=dataclasses.replace(LEAN, prefill_chunk=128), prompt=384), MODEL, 10**12
    )
    assert chunked.sampler_temp_bytes < lean.sampler_temp_bytes


def test_a_run_that_cannot_fit_names_the_phase_and_the_settings():
    plan = plan_memory(config(), MODEL, device_bytes=10**12)
    tight = dataclasses.replace(plan, usable_bytes=plan.peak_bytes - 1)
    assert not tight.fits
    why = tight.refusal(config())
    assert "the train step needs" in why and "memory.remat=true" in why
    assert "optim.micro_batch_size (now 4)" in why
    sampler_heavy = dataclasses.replace(
        tight, train_step_bytes=0, usable_bytes=tight.sampler_bytes - 1
    )
    assert "sampler.batch (now 6)" in sampler_heavy.refusal(config())
    assert plan.refusal(config()) is None


def test_train_refuses_before_reading_weights(checkpoints, monkeypatch):
    from models import hf

    cfg = dataclasses.replace(
        config(prompt=48, completion=16), model_path=str(checkpoints["llama31"])
    )
    assert check_fits(cfg).fits
    monkeypatch.setattr(hf, "device_memory_bytes", lambda device=None: 10**6)
    with pytest.raises(UserError, match=r"needs .* GB, 0\.0 GB usable of 0\.0; try"):
        check_fits(cfg)
    off = dataclasses.replace(cfg, memory=MemoryConfig(check_fit=False))
    assert check_fits(off) is None
    unbounded = dataclasses.replace(cfg, sampler=SamplerConfig(max_prompt_tokens=None))
    assert check_fits(unbounded) is None  # no longest prompt: nothing to plan (a warning)


def test_plan_command_reads_a_train_config_without_its_checkpoint(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text(
        "task: {name: hover}\n"
        "mmgrpo:\n"
        "  model_path: /not/here\n"
        "  sampler: {max_prompt_tokens: 48, max_completion_tokens: 16, batch: 3}\n"
    )
    assert cli.main(["plan", "--config", str(path)]) == 2
    assert "neither mmgrpo.model_shape nor --preset" in capsys.readouterr().err
    assert cli.main(["plan", "--config", str(path), "--preset", "gpt5"]) == 2
    assert "'gpt5' is not a preset" in capsys.readouterr().err


def test_plan_refuses_a_key_outside_the_section_it_reads(tmp_path, capsys):
    """`sampler.max_prompt_tokens=` on a train config once planned the file's own cap,
    silently; so did a bare config's keys once an `mmgrpo.` override made the section."""
    train = tmp_path / "experiment.yaml"
    train.write_text("task: {name: hover}\nmmgrpo: {model_path: /not/here}\n")
    bare = tmp_path / "bare.yaml"
    bare.write_text("sampler: {max_prompt_tokens: 48}\n")
    for argv in (
        ["--config", str(train), "sampler.max_prompt_tokens=512"],
        ["--config", str(bare), "mmgrpo.model_path=/not/here"],
    ):
        assert cli.main(["plan", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            "mmgrpo plan: 'sampler' sits outside the mmgrpo section that plan reads, so it would "
            "change nothing; write it as mmgrpo.sampler"
        ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device-memory-gb", "0"], "--device-memory-gb must be > 0, got 0.0"),
        (["--device-memory-gb", "-5"], "--device-memory-gb must be > 0, got -5.0"),
        (["--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1], got 1.5"),
    ],
)
def test_plan_refuses_an_impossible_device_in_one_line(tmp_path, capsys, flags, message):
    argv = ["plan", "--preset", "qwen3-8b", *flags, "mmgrpo.sampler.max_prompt_tokens=48"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mmgrpo plan: {message}"]


def test_plan_refuses_a_model_folder_without_a_checkpoint(tmp_path, capsys):
    empty = tmp_path / "Qwen3-8B"
    empty.mkdir()
    argv = ["plan", "--preset", "qwen3-8b", f"mmgrpo.model_path={empty}"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"mmgrpo.model_path='{empty}' exists but holds no checkpoint" in err[0]


def test_plan_command_json_from_a_checkpoint(checkpoints, tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text(
        f"mmgrpo:\n  model_path: {checkpoints['qwen3_tied']}\n"
        "  sampler: {max_prompt_tokens: 48, max_completion_tokens: 16}\n"
    )
    argv = [
        "plan",
        "--config",
        str(path),
        "--json",
        "--device-memory-gb",
        "2",
        "mmgrpo.dtype=float32",
    ]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device_bytes"] == 2 * 10**9 and out["usable_bytes"] == 1.5 * 10**9
    assert out["fits"] is True and out["train_step_bytes"] > 0 and out["sampler_bytes"] > 0


def test_the_cpu_plan_options_act_in_a_process_that_compiled_before():
    """A bfloat16 policy on a CPU host: XLA's CPU-only hoisted float32 copies are left out by
    the plan's own compile options, even after this process compiled (XLA_FLAGS, which a
    process reads once, were silently ignored there: the 8B plan read 97 GB, not 49)."""
    cfg = dataclasses.replace(config(memory=LEAN, prompt=128, completion=32), dtype="bfloat16")
    plain = plan_memory(cfg, MODEL, 10**12)  # jax's backend is up and has compiled
    gpu_like = plan_memory(cfg, MODEL, 10**12, compiler_options=CPU_PLAN_OPTIONS)
    assert gpu_like.train_temp_bytes < plain.train_temp_bytes
    assert gpu_like.weights_bytes == plain.weights_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hover_qwen3_8b", "hover_llama31_8b"])
def test_the_paper_configs_fit_one_h200(name, capsys):
    """The README's table: ~40 s each on 2 cores (8B shapes compiled, nothing allocated), in
    any order with the other tests."""
    argv = ["plan", "--config", f"experiments/configs/{name}.yaml", "--device-memory-gb", "141"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is True, out
    assert out["train_step_bytes"] <= 100e9 and out["sampler_bytes"] <= 100e9


def test_a_loaded_policy_carries_the_memory_settings_before_any_engine_splits_it(
    checkpoints, monkeypatch
):
    from mmgrpo_jax.trainer import policy
    from models.hf import from_pretrained

    def weights_only(path, **kwargs):  # these checkpoints have no tokenizer files
        return from_pretrained(path, dtype=kwargs["dtype"], lora=kwargs["lora"]), None, ()

    monkeypatch.setattr(policy, "load_checkpoint", weights_only)
    cfg = dataclasses.replace(config(memory=LEAN), model_path=str(checkpoints["llama31"]))
    model, _, _ = policy.load_policy(cfg)
    assert model.attention == LEAN.attention_config and model.remat


def test_a_pallas_config_is_planned_as_blockwise_off_a_gpu(caplog):
    """The Pallas interpreter's buffers say nothing of the kernel's: a CPU host plans the
    kernel's tile-at-a-time footprint with the blockwise path, and says so."""
    small = {"prompt": 112, "completion": 16, "micro_batch": 2, "sampler_batch": 2}
    apart = {"share_prompts": False}  # the kernel takes segments, not a prefix tree
    pallas = plan_memory(config(MemoryConfig("pallas", 64, **apart), **small), MODEL, 10**12)
    blockwise = plan_memory(config(MemoryConfig("blockwise", 64, **apart), **small), MODEL, 10**12)
    assert pallas.train_step_bytes == blockwise.train_step_bytes
    assert "planning memory.attention=pallas as blockwise on this cpu host" in caplog.text
