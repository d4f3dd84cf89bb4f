"""Adapters and merged weights out to (and adapters back from) the formats PEFT, vLLM and HF read.

PEFT stores lora_A as [r, in] and lora_B as [out, r] under
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight``; ours are [in, r]
and [r, out], so both are transposed. Merged checkpoints hold W + (alpha/r) A B in HF names.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from models.config import CheckpointError
from models.decoder import Decoder
from models.hf import hf_key, layer_paths
from models.lora import Linear, LoRAConfig
from models.sharding import path_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MODULES = "modules.json"  # per-module adapters: which predictors each adapter served

logger = logging.getLogger(__name__)


def _lora_layers(model: Decoder) -> list[tuple[tuple, Linear]]:
    return [
        (path, node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, Linear) and node.lora is not None
    ]


def _per_layer(path: tuple, value: np.ndarray) -> list[tuple[tuple, np.ndarray]]:
    """(per-layer path, tensor) pairs: a block's stacked parameter splits along its layer axis."""
    if path and path[0] == "layers":
        return list(zip(layer_paths(path, value.shape[0]), value, strict=True))
    return [(tuple(path), value)]


def peft_key(path: tuple, factor: str) -> str:
    """PEFT name of a LoRA factor ('A' or 'B') of the Linear at `path`."""
    return f"base_model.model.model.{path_name(path)}.lora_{factor}.weight"


def save_peft_adapter(model: Decoder, directory: str | Path, base_model: str = "") -> Path:
    """The adapter as a PEFT folder; with per-module adapters, one PEFT folder per adapter under
    `directory` (named after it) and `modules.json`, the predictor patterns that chose them.
    `base_model` (the checkpoint it was trained on) becomes PEFT's `base_model_name_or_path`,
    which loading checks against the model it is loaded into."""
    lora = _require_lora(model)
    directory = Path(directory)
    # a folder saved before in the other layout keeps no file that would be read instead
    stale = (ADAPTER_WEIGHTS, ADAPTER_CONFIG) if lora.num_adapters > 1 else (MODULES,)
    for name in stale:
        (directory / name).unlink(missing_ok=True)
    if lora.num_adapters == 1:
        return _save_one(model, lora, directory, base_model, 0)
    for index, name in enumerate(lora.adapter_names):
        _save_one(model, lora, directory / name, base_model, index)
    modules = {"modules": list(lora.modules), "adapters": list(lora.adapter_names)}
    (directory / MODULES).write_text(json.dumps(modules, indent=2))
    return directory


def _save_one(
    model: Decoder, lora: LoRAConfig, directory: Path, base_model: str, adapter: int
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, layer in _lora_layers(model):
        for factor, param in (("A", layer.lora_a), ("B", layer.lora_b)):
            value = _one_adapter(path, np.asarray(jax.device_get(param[...])), lora, adapter)
            for layer_path, per_layer in _per_layer(path, value):
                tensors[peft_key(layer_path, factor)] = per_layer.T.copy()
    save_file(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return directory


def _adapter_axis(path: tuple) -> int:
    """Where a stacked LoRA factor keeps its adapter axis: after the layer axis of a block."""
    return 1 if path and path[0] == "layers" else 0


def _one_adapter(path: tuple, value: np.ndarray, lora: LoRAConfig, adapter: int) -> np.ndarray:
    if lora.num_adapters == 1:
        return value
    return np.take(value, adapter, axis=_adapter_axis(path))


def adapter_lora_config(directory: str | Path) -> LoRAConfig:
    """The LoRAConfig a saved PEFT adapter (or a per-module adapters folder) was trained with:
    build the model with it, then load."""
    directory = Path(directory)
    modules = _modules(directory)
    first = directory if modules is None else directory / modules["adapters"][0]
    path = first / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in {str(first)!r}")
    config = json.loads(path.read_text())
    return LoRAConfig(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        targets=tuple(config["target_modules"]),
        dropout=float(config.get("lora_dropout") or 0.0),
        modules=() if modules is None else tuple(modules["modules"]),
    )


def _modules(directory: Path) -> dict | None:
    path = directory / MODULES
    return json.loads(path.read_text()) if path.is_file() else None


def load_peft_adapter(model: Decoder, directory: str | Path, base_model: str = "") -> Decoder:
    """Copy a PEFT adapter (per-module adapters: the folder `save_peft_adapter` wrote) into
    `model`'s LoRA parameters (in place; sharding kept). `base_model` names `model`'s checkpoint
    for the check against the adapter's own base: an adapter of another model's shape is a
    `CheckpointError` naming both; a differently named base of the same shape, a warning."""
    lora = _require_lora(model)
    directory = Path(directory)
    modules = _modules(directory)
    names = None if modules is None else tuple(modules["adapters"])
    if lora.num_adapters > 1 or names is not None:
        if names != lora.adapter_names:
            raise ValueError(
                f"{str(directory)!r} holds adapters {names}, the model has "
                f"{list(lora.adapter_names)}; build it with adapter_lora_config(directory)"
            )
        for index, name in enumerate(names):
            _load_one(model, lora, directory / name, index, base_model)
        return model
    _load_one(model, lora, directory, 0, base_model)
    return model


def _load_one(
    model: Decoder, lora: LoRAConfig, directory: Path, adapter: int, base_model: str
) -> None:
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"no {name} in {str(directory)!r}")
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    trained_on = config.get("base_model_name_or_path") or ""

    def other_model(what: str) -> CheckpointError:
        return CheckpointError(
            f"the adapter {str(directory)!r} was trained on "
            f"{repr(trained_on) if trained_on else 'a base it does not name'}, not on the model "
            f"{repr(base_model) if base_model else 'it is loaded into'}: {what}; load it into "
            "the model it was trained on"
        )

    if trained_on and base_model and trained_on != base_model:
        logger.warning(
            "the adapter %s was trained on %r, loaded into %r (same shapes or refused below)",
            directory,
            trained_on,
            base_model,
        )
    found = {
        "r": config.get("r"),
        "lora_alpha": config.get("lora_alpha"),
        "target_modules": sorted(config.get("target_modules") or []),
    }
    wanted = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": sorted(lora.targets)}
    if found != wanted:
        raise ValueError(f"adapter config {found} does not match the model's LoRAConfig {wanted}")
    tensors = load_file(directory / ADAPTER_WEIGHTS)
    for path, layer in _lora_layers(model):
        for factor, param in (("A", layer.lora_a), ("B", layer.lora_b)):
            current = param[...]
            shape = _one_adapter(path, np.empty(current.shape, np.int8), lora, adapter).shape
            stacked = path[0] == "layers"
            parts = []
            for layer_path, want in _per_layer(path, np.empty(shape, np.int8)):
                key = peft_key(layer_path, factor)
                if key not in tensors:
                    raise other_model(f"it has no tensor {key!r} (the model is deeper)")
                value = tensors.pop(key).T
                if value.shape != want.shape:
                    raise other_model(
                        f"its tensor {key!r} has shape {value.shape[::-1]}, the model's "
                        f"{want.shape[::-1]}"
                    )
                parts.append(value)
            value = np.stack(parts) if stacked else parts[0]
            if lora.num_adapters > 1:  # this adapter's slice of the stack
                whole = np.array(jax.device_get(current))
                index = [slice(None)] * whole.ndim
                index[_adapter_axis(path)] = adapter
                whole[tuple(index)] = value
                value = whole
            param[...] = jax.device_put(jnp.asarray(value, current.dtype), current.sharding)
    if tensors:
        raise other_model(
            f"{len(tensors)} of its tensors have no LoRA layer in the model, e.g. "
            f"{sorted(tensors)[0]!r}"
        )


def merge_lora(model: Decoder, adapter: str | None = None) -> Decoder:
    """A LoRA-free Decoder whose kernels are W + (alpha/r) A B; other weights are shared. With
    per-module adapters `adapter` names the one to merge (a merged model serves one module)."""
    index = _adapter_to_merge(_require_lora(model), adapter)
    abstract = nnx.eval_shape(lambda: Decoder(model.config, dtype=model.dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    merged = []
    for path, var in nnx.to_flat_state(state):
        owner = functools.reduce(
            lambda node, key: node[key] if isinstance(key, int) else getattr(node, key),
            path[:-1],
            model,
        )
        if path[-1] == "kernel":
            value = owner.merged_kernel(index)
        else:
            value = getattr(owner, str(path[-1]))[...]
        merged.append((path, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(merged))


def without_lora(model: Decoder) -> Decoder:
    """The base model, sharing `model`'s base weights (no copy): a frozen reference, a judge."""
    abstract = nnx.eval_shape(lambda: Decoder(model.config, dtype=model.dtype, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    return nnx.merge(graphdef, nnx.state(model, nnx.Not(nnx.LoRAParam)))


def hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """Every parameter of a LoRA-free model under its HF name, in HF's [out, in] layout."""
    if model.lora is not None:
        raise ValueError("merge the adapter first: hf_tensors(merge_lora(model))")
    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        for layer_path, value in _per_layer(path, np.asarray(jax.device_get(var.get_value()))):
            key, transpose = hf_key(layer_path)
            tensors[key] = value.T.copy() if transpose else value
    return tensors


def save_merged(model: Decoder, directory: str | Path, adapter: str | None = None) -> Path:
    """An HF checkpoint (config.json + model.safetensors) of the merged model (with per-module
    adapters: of adapter `adapter`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = jnp.dtype(model.dtype).name
    (directory / "config.json").write_text(json.dumps(model.config.to_hf(dtype), indent=2))
    merged = merge_lora(model, adapter) if model.lora is not None else model
    save_file(hf_tensors(merged), directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def _adapter_to_merge(lora: LoRAConfig, adapter: str | None) -> int:
    names = lora.adapter_names
    if adapter is None and len(names) > 1:
        raise ValueError(
            f"the model has {len(names)} adapters {list(names)} (per-module LoRA): name the one "
            "to merge (adapter=...)"
        )
    if adapter is not None and adapter not in names:
        raise ValueError(f"adapter={adapter!r} is not one of the model's adapters {list(names)}")
    return 0 if adapter is None else names.index(adapter)


def _require_lora(model: Decoder) -> LoRAConfig:
    if model.lora is None:
        raise ValueError("the model has no LoRA adapter; build it with lora=LoRAConfig(...)")
    return model.lora
