import json
from pathlib import Path

import pytest

from mmgrpo_jax import cli
from mmgrpo_jax.commands import experiment
from mmgrpo_jax.config_files import load_config
from mmgrpo_jax.rl.losses import LossConfig
from mmgrpo_jax.trainer.config import MMGRPOConfig, OptimConfig, SamplerConfig
from models.lora import LoRAConfig
from programs import retrieval, tasks
from programs.tasks import ExternalLMConfig, TaskConfig
from tests.paper_data import skip_without_paper_data
from tests.tiny_checkpoint import write_tiny_checkpoint

CONFIGS = Path(__file__).parents[2] / "experiments" / "configs"
SHORT = ExternalLMConfig(max_tokens=6)
PREDICTORS = {
    "banking77": {"classify"},
    "papillon": {"craft_redacted_request", "respond_to_query"},
    "hover": {"write_query", "take_notes"},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    skip_without_paper_data()  # its tokenizer is trained on the paper tasks' text
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Retrieval indexes and the proxy corpus go to the test's folder, not ~/.cache."""
    monkeypatch.setattr(retrieval, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.setattr(tasks, "DEFAULT_CACHE", tmp_path / "cache")


def task_config(name):
    return TaskConfig(name, untrusted_lm=SHORT, judge_lm=SHORT, hops=2, passages_per_hop=2)


@pytest.mark.parametrize("grouping", ["module", "trajectory"])
@pytest.mark.parametrize("name", ["banking77", "papillon", "hover"])
def test_one_mmgrpo_step_on_each_paper_program(checkpoint, tmp_path, name, grouping):
    cfg = experiment.ExperimentConfig(
        task=task_config(name),
        mmgrpo=MMGRPOConfig(
            grouping=grouping,
            num_rollouts=2,
            examples_per_step=2,
            num_steps=1,
            sampler=SamplerConfig(max_completion_tokens=6, max_wait_s=5.0),
            format_failure_score=-1.0,
            eval_every=1,
            model_path=str(checkpoint),
            dtype="float32",
            lora=LoRAConfig(rank=2, alpha=4.0),
            loss=LossConfig("grpo", beta=0.04),
            optim=OptimConfig(lr=1e-2, micro_batch_size=8),
            run_dir=str(tmp_path / "run"),
            progress=False,
        ),
        train_limit=2,
        val_limit=1,
    )
    summary = experiment.run_train(cfg)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in lines if "loss" in r or "trajectories" in r)
    assert step["trajectories"] == 4
    assert step["status_ok"] + step["status_format_failure"] + step["status_error"] == 4
    assert step["calls"] >= 4  # every rollout reached its first module
    assert summary["steps"] == 1 and summary["grouping"] == grouping
    saved = json.loads((tmp_path / "run" / "program.json").read_text())
    assert set(saved) == PREDICTORS[name]
    assert (tmp_path / "run" / "adapter" / "adapter_config.json").is_file()


def test_per_module_adapters_train_and_evaluate_through_the_cli(checkpoint, tmp_path, capsys):
    """papillon's two modules on adapters of their own: one step, the per-adapter PEFT folders,
    and `mmgrpo eval --adapter` on them (each module back on its adapter)."""
    modules = ("craft*=redactor", "respond*=responder")
    cfg = experiment.ExperimentConfig(
        task=task_config("papillon"),
        mmgrpo=MMGRPOConfig(
            num_rollouts=2,
            examples_per_step=2,
            num_steps=1,
            sampler=SamplerConfig(max_completion_tokens=6, max_wait_s=5.0),
            eval_every=1,
            model_path=str(checkpoint),
            dtype="float32",
            lora=LoRAConfig(rank=2, alpha=4.0, modules=modules),
            optim=OptimConfig(lr=1e-2, micro_batch_size=8),
            run_dir=str(tmp_path / "run"),
            progress=False,
        ),
        train_limit=2,
        val_limit=1,
    )
    assert experiment.run_train(cfg)["steps"] == 1
    adapter = tmp_path / "run" / "adapter"
    assert sorted(p.name for p in adapter.iterdir()) == ["modules.json", "redactor", "responder"]
    argv = ["eval", "--program", "papillon", "--model", str(checkpoint), "--adapter", str(adapter)]
    argv += ["--split", "dev", "--limit", "1", "--out", str(tmp_path / "p.jsonl")]
    argv += ["max_completion_tokens=6", "dtype=float32", "task.untrusted_lm.max_tokens=6"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["examples"] == 1


def test_eval_cli_prints_the_metric_and_writes_predictions(checkpoint, tmp_path, capsys):
    out = tmp_path / "preds.jsonl"
    argv = ["eval", "--program", "banking77", "--model", str(checkpoint), "--split", "dev"]
    argv += ["--limit", "3", "--out", str(out), "max_completion_tokens=8", "dtype=float32"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "banking77" and result["examples"] == 3
    assert 0.0 <= result["metric"] <= 1.0
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(records) == 3 and {"inputs", "labels", "prediction", "score", "status"} <= set(
        records[0]
    )
    assert records[0]["labels"]["label"] and records[0]["status"] in ("ok", "format_failure")
    [call] = records[0]["calls"]  # Banking77's one module, its reply as sampled
    assert call["module"] == "classify" and isinstance(call["reply"], str)


def test_missing_checkpoint_and_oversized_model_are_messages_not_tracebacks(
    checkpoint, tmp_path, capsys, monkeypatch
):
    assert cli.main(["eval", "--program", "hover", "--model", str(tmp_path / "none")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()  # one line, no usage block
    assert line.startswith("mmgrpo eval: ") and "model_path=" in line
    config = tmp_path / "train.yaml"
    config.write_text(f"task: {{name: banking77}}\nmmgrpo: {{model_path: {tmp_path / 'gone'}}}\n")
    assert cli.main(["train", "--config", str(config)]) == 2
    assert "MMGRPOConfig.model_path" in capsys.readouterr().err
    from models import hf

    monkeypatch.setattr(hf, "device_memory_bytes", lambda device=None: 1024)
    argv = ["eval", "--program", "banking77", "--model", str(checkpoint), "--limit", "1"]
    assert cli.main(argv) == 2
    assert "GiB" in capsys.readouterr().err


PAPER_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.stem.endswith("_smollm2"))
REAL_LM_CONFIGS = sorted(CONFIGS.glob("*_smollm2.yaml"))


@pytest.mark.parametrize("path", PAPER_CONFIGS, ids=lambda p: p.stem)
def test_paper_configs_load_with_the_paper_setting(path, checkpoint):
    cfg = load_config(
        experiment.ExperimentConfig, path, [f"mmgrpo.model_path={checkpoint}", "task.data_dir=null"]
    )
    task, model = path.stem.split("_", 1)
    assert cfg.task.name == task and model in ("llama31_8b", "qwen3_8b")
    m = cfg.mmgrpo
    assert (m.lora.rank, m.optim.lr, m.examples_per_step, m.num_rollouts) == (16, 1e-5, 4, 12)
    assert m.sampler.max_prompt_tokens + m.sampler.max_completion_tokens == 8192
    assert m.num_steps == 750 and m.sampler.batch == 48
    assert m.model_shape == model.replace("_", "-") and m.optim.micro_batch_size == 8
    assert m.memory.attention == "blockwise" and m.memory.remat  # what fits an H200
    assert m.resolved_loss.max_completion_length == 2048  # dr_grpo's normaliser: the sampler's
    assert (cfg.prompt_opt.candidates, cfg.prompt_opt.valset_size) == (6, 100)  # auto light
    assert cfg.strategy == "p -> w" and cfg.prompt_lm.temperature == 1.0
    assert cfg.prompts_dir == Path(m.run_dir) / "prompts"
    with pytest.raises(ValueError, match=r"MMGRPOConfig\.model_path"):
        load_config(experiment.ExperimentConfig, path)  # the 8B checkpoints are not on this machine


@pytest.mark.parametrize("path", REAL_LM_CONFIGS, ids=lambda p: p.stem)
def test_the_real_lm_configs_name_the_registry_model(path, tmp_path, monkeypatch):
    """Each *_smollm2.yaml says `model_path: smollm2-135m`: a fetched model resolves, a
    missing one is a config error that says how to fetch it."""
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"run `mmgrpo models fetch smollm2-135m`"):
        load_config(experiment.ExperimentConfig, path)
    folder = tmp_path / "cache" / "models" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / ".complete").write_text("")
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    cfg = load_config(experiment.ExperimentConfig, path)
    assert f"{cfg.task.name}_".startswith(path.stem.split("_")[0])
    assert cfg.mmgrpo.model_path == "smollm2-135m"
    assert cfg.mmgrpo.dtype == "float32" and cfg.mmgrpo.sampler.max_completion_tokens <= 64


def experiment_yaml(tmp_path, checkpoint, strategy="p -> w"):
    """banking77 on the tiny checkpoint; its frozen base weights are the prompt model."""
    config = tmp_path / "experiment.yaml"
    config.write_text(
        f"""
task: {{name: banking77}}
mmgrpo:
  model_path: {checkpoint}
  dtype: float32
  sampler: {{max_completion_tokens: 6, max_wait_s: 5.0}}
  num_rollouts: 2
  examples_per_step: 2
  num_steps: 1
  eval_every: 10
  lora: {{rank: 2, alpha: 4.0}}
  optim: {{lr: 1.0e-2, micro_batch_size: 8}}
  run_dir: {tmp_path / "run"}
  progress: false
prompt_opt:
  auto: null
  num_candidates: 2
  num_trials: 2
  minibatch_size: 2
  bootstrap_pool: 2
  summary_examples: 2
  summary_batch: 2
prompt_lm: {{max_tokens: 8}}
strategy: "{strategy}"
train_limit: 4
val_limit: 3
test_limit: 2
"""
    )
    return str(config)


def printed_json(text):
    return json.loads(text[text.index("{") :])


def test_optimize_prompts_dry_run_then_run_then_train_from_its_prompts(
    checkpoint, tmp_path, capsys
):
    config = experiment_yaml(tmp_path, checkpoint)
    prompts = tmp_path / "run" / "prompts"
    assert cli.main(["optimize-prompts", "--config", config, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    budget = int(printed.split("MIPROv2 budget: ")[1].split()[0])
    assert budget == 2 + 2 * 2 + 2 * 3  # bootstrap + 2 minibatches of 2 + 2 full evals of 3
    assert printed_json(printed) == {"dry_run": True} and not prompts.exists()
    # the budget needs no weights: the same with a model_path that is not on this machine
    away = ["optimize-prompts", "--config", config, "--dry-run", "mmgrpo.model_path=/not/here"]
    assert cli.main(away) == 0
    assert f"MIPROv2 budget: {budget} program runs" in capsys.readouterr().out

    assert cli.main(["optimize-prompts", "--config", config]) == 0
    result = printed_json(capsys.readouterr().out)
    assert result["valset_chosen"] >= result["valset_default"]
    assert 0 < result["program_runs"] <= budget
    state = json.loads((prompts / "prompt_state.json").read_text())
    assert set(state) == {"classify"}
    trials = [json.loads(x) for x in (prompts / "trials.jsonl").read_text().splitlines()]
    assert trials[0]["trial"] == 0 and trials[0]["kind"] == "full"
    assert json.loads((prompts / "config.json").read_text())["strategy"] == "p -> w"

    argv = ["train", "--config", config, f"prompt_state={prompts / 'prompt_state.json'}"]
    argv.append(f"mmgrpo.run_dir={tmp_path / 'trained'}")
    assert cli.main(argv) == 0
    trained = json.loads((tmp_path / "trained" / "program.json").read_text())
    assert trained == state  # the weight stage trains on these prompts and leaves them alone


def test_better_together_cli_records_every_stage_and_saves_the_best(checkpoint, tmp_path, capsys):
    assert cli.main(["better-together", "--config", experiment_yaml(tmp_path, checkpoint)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("MIPROv2 budget: ")
    result = printed_json(printed)
    assert [s["stage"] for s in result["stages"]] == ["start", "p", "w"]
    best = max(result["stages"], key=lambda s: s["valset"])
    assert result["best"] == best["stage"]
    best_dir = tmp_path / "run" / "best"
    assert json.loads((best_dir / "better_together.json").read_text()) == result
    assert set(json.loads((best_dir / "program.json").read_text())) == {"classify"}
    assert (best_dir / "adapter" / "adapter_config.json").is_file()
    # summary.json is what a sweep reads: every stage on the valset and the unseen test split
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stages"] == result["stages"] and summary["best"] == result["best"]
    assert all(0 <= s["test"] <= 1 for s in result["stages"])
    chosen = result["stages"][result["best_index"]]
    assert summary["test_after"] == chosen["test"] and summary["valset_after"] == best["valset"]
    assert summary["test_gain"] == chosen["test"] - result["stages"][0]["test"]
    assert summary["weight_stage"]["steps"] == 1  # the mmGRPO stage's own summary, kept
    assert summary["wall_seconds"] > 0
    # strategy=none: the program as written, scored on both splits (a Table 1 baseline row)
    none = ["better-together", "--config", experiment_yaml(tmp_path, checkpoint, "none")]
    assert cli.main([*none, f"mmgrpo.run_dir={tmp_path / 'vanilla'}"]) == 0
    vanilla = json.loads((tmp_path / "vanilla" / "summary.json").read_text())
    assert [s["stage"] for s in vanilla["stages"]] == ["start"]
    assert vanilla["test_after"] == vanilla["test_start"] == result["stages"][0]["test"]
    assert vanilla["weight_stage"] is None
    assert (
        cli.main(["better-together", "--config", experiment_yaml(tmp_path, checkpoint, "w -> w")])
        == 2
    )
    assert "one weight stage at most" in capsys.readouterr().err


def test_better_together_reads_its_start_scores_from_a_run_of_the_program_as_written(
    checkpoint, tmp_path, capsys
):
    """What a sweep's cells do with its strategy=none cell's run: the start stage is not scored
    again, and the trainer's own step-0 evaluation of the same program finds the same number."""
    written = ["better-together", "--config", experiment_yaml(tmp_path, checkpoint, "none")]
    assert cli.main([*written, f"mmgrpo.run_dir={tmp_path / 'as_written'}"]) == 0
    vanilla = printed_json(capsys.readouterr().out)
    scores = tmp_path / "as_written" / "summary.json"
    argv = ["better-together", "--config", experiment_yaml(tmp_path, checkpoint, "w")]
    assert cli.main([*argv, f"start_scores={scores}", "mmgrpo.eval_every=1"]) == 0
    result = printed_json(capsys.readouterr().out)
    assert result["stages"][0] == vanilla["stages"][0] and result["start_scores"] == str(scores)
    curve = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    step0 = [r["eval_reward"] for r in curve if r["step"] == 0 and "eval_reward" in r]
    assert step0 == [vanilla["stages"][0]["valset"]]
    for bad, message in [
        ("strategy=none", "strategy='none' is the run that scores the start stage"),
        (f"start_scores={tmp_path / 'run' / 'summary.json'}", "not the summary.json of a strategy"),
    ]:
        assert cli.main([*argv, f"start_scores={scores}", bad]) == 2
        assert message in capsys.readouterr().err


def test_better_together_loads_a_finished_search_as_its_prompt_stage(checkpoint, tmp_path, capsys):
    """What a sweep's BetterTogether cell does with its MIPROv2 cell's run: no search, the
    searched prompts as the p stage, scored as the search's own run scored them."""
    searched = ["better-together", "--config", experiment_yaml(tmp_path, checkpoint, "p")]
    assert cli.main([*searched, f"mmgrpo.run_dir={tmp_path / 'search'}"]) == 0
    search = printed_json(capsys.readouterr().out)
    prompts = tmp_path / "search" / "prompts" / "prompt_state.json"
    argv = ["better-together", "--config", experiment_yaml(tmp_path, checkpoint)]
    assert cli.main([*argv, f"prompt_stage={prompts}"]) == 0
    printed = capsys.readouterr().out
    assert "MIPROv2 budget" not in printed  # nothing searched
    result = printed_json(printed)
    assert [s["stage"] for s in result["stages"]] == ["start", "p", "w"]
    assert result["stages"][:2] == search["stages"]  # valset and test scores of start and p
    assert result["prompt_stage"] == str(prompts) and search["prompt_stage"] is None
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["prompt_stage"] == str(prompts)
    if result["best"] != "start":  # the loaded prompts are what the run trained and saved
        best = json.loads((tmp_path / "run" / "best" / "program.json").read_text())
        assert best == json.loads(prompts.read_text())
