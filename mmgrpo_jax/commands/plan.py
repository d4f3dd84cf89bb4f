"""`mmgrpo plan`: the memory plan of a training config, before any weight is read.

It reads a train config (its `mmgrpo` section; the task's sections are ignored), takes the model's
shape from `<model_path>/config.json` when that exists and from the named preset
(`mmgrpo.model_shape` or `--preset`) otherwise, and compiles the train step and the sampler on
abstract inputs (trainer.plan). Runs on a CPU host for an 8B GPU config in about a minute.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import TextIO

from mmgrpo_jax.config_files import build_config, config_tree
from mmgrpo_jax.errors import UserError

# XLA's CPU compiler hoists float32 copies of the stacked weights and of the saved block inputs
# out of the layer loop (its dots have no bfloat16 kernels): ~45 GB that a GPU compile does not
# allocate at Qwen3-8B. A CPU plan of a GPU run therefore compiles without that pass. These are
# options of the plan's own compiles, not XLA_FLAGS, which a process reads once: a plan after
# anything else was compiled (a test suite, a notebook) would silently count the copies.
CPU_PLAN_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    config: str | None
    overrides: tuple[str, ...] = ()
    preset: str | None = None
    device_memory_gb: float | None = None  # default: this machine's first device
    # default: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75 of a GPU (1.0 of this CPU host)
    memory_fraction: float | None = None
    as_json: bool = False


def _cpu_only() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0] == "cpu"
    return importlib.util.find_spec("jax_plugins") is None and (
        importlib.util.find_spec("jax_cuda12_plugin") is None
    )


def _refuse_ignored_keys(tree: object) -> None:
    """A config with an `mmgrpo` section is planned from that section alone: an MMGRPOConfig key
    beside it (an override `sampler.max_prompt_tokens=...` on a train config, or a bare config's
    own keys once an `mmgrpo.` override made the section) would change nothing."""
    from mmgrpo_jax.trainer.config import MMGRPOConfig

    if not isinstance(tree, dict) or "mmgrpo" not in tree:
        return
    fields = {f.name for f in dataclasses.fields(MMGRPOConfig)}
    for key in tree:
        if key in fields:
            raise UserError(
                f"{key!r} sits outside the mmgrpo section that plan reads, so it would change "
                f"nothing; write it as mmgrpo.{key}"
            )


def run(request: PlanRequest, out: TextIO) -> int:
    if request.device_memory_gb is not None and not request.device_memory_gb > 0:
        raise UserError(f"--device-memory-gb must be > 0, got {request.device_memory_gb}")
    if request.memory_fraction is not None and not 0 < request.memory_fraction <= 1:
        raise UserError(f"--memory-fraction must be in (0, 1], got {request.memory_fraction}")
    from mmgrpo_jax.trainer.config import MMGRPOConfig
    from mmgrpo_jax.trainer.plan import plan_memory, usable_fraction
    from models.config import preset
    from models.hf import device_memory_bytes

    try:
        tree = config_tree(request.config, request.overrides)
        _refuse_ignored_keys(tree)
        section = dict(tree.get("mmgrpo", tree) if isinstance(tree, dict) else {})
        model_path = section.pop("model_path", None)  # may not be on this machine: no check
        config = build_config(MMGRPOConfig, section, "mmgrpo.")
    except (ValueError, FileNotFoundError) as err:
        raise UserError(str(err)) from None
    config_json = Path(model_path) / "config.json" if model_path else None
    shape_name = request.preset or config.model_shape
    on_disk = _shape_on_disk(model_path)
    if on_disk is not None:
        model_config, name = on_disk, str(model_path)
    elif shape_name is not None:
        try:
            model_config, name = preset(shape_name), shape_name
        except ValueError as err:
            raise UserError(str(err)) from None
    else:
        raise UserError(
            f"no model shape: {str(config_json or 'mmgrpo.model_path')!r} is not on this "
            "machine and neither mmgrpo.model_shape nor --preset names a preset"
        )
    fraction = request.memory_fraction
    if request.device_memory_gb is not None:  # planning for another machine: a GPU's share
        device = int(request.device_memory_gb * 1e9)
        fraction = usable_fraction("gpu") if fraction is None else fraction
    else:
        device = device_memory_bytes()
    plan = plan_memory(
        config,
        model_config,
        device,
        model_name=name,
        memory_fraction=fraction,
        compiler_options=CPU_PLAN_OPTIONS if _cpu_only() else None,
    )
    if request.as_json:
        print(json.dumps(plan.to_json()), file=out)
    else:
        print(plan.table(), file=out)
        refusal = plan.refusal(config)
        if refusal:
            print(f"\n{refusal}", file=out)
    return 0


def _shape_on_disk(model_path: str | None):
    """The checkpoint's shape when it is on this machine (a folder's config.json, a GGUF, a
    fetched registry model), else None. A path that exists but holds no checkpoint is an error:
    the preset stands in only for a checkpoint that is elsewhere."""
    from models.config import CheckpointError
    from models.hf import checkpoint_config

    if not model_path:
        return None
    try:
        return checkpoint_config(model_path)
    except (FileNotFoundError, CheckpointError) as err:
        if Path(model_path).exists():
            raise UserError(
                f"mmgrpo.model_path={model_path!r} exists but holds no checkpoint ({err}); "
                "point it at a checkpoint folder, or at a path not on this machine to plan "
                "with mmgrpo.model_shape / --preset"
            ) from None
        return None
