"""HF checkpoints <-> our parameter tree: key mapping, per-tensor shape checks, safetensors IO.

A GGUF file (models.gguf) is read through the same HF names, so one loader serves both.

Our kernels are [in, out]; HF stores [out, in], so every `kernel` is transposed on the way in and
out. Tensors are read with numpy (memory-mapped) and placed straight onto their devices, shard by
shard when a mesh is given; torch is never imported.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from models.config import CheckpointError, ModelConfig
from models.decoder import Decoder
from models.fetch import resolve_model_path
from models.gguf import GGUFCheckpoint, find_gguf
from models.lora import LoRAConfig
from models.sharding import param_sharding, path_name
from models.tokenizer import TOKENIZER_FILES, HFTokenizer, load_tokenizer, stop_token_ids

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def layer_paths(path: Sequence[object], num_layers: int) -> list[tuple[object, ...]]:
    """The per-layer paths of a parameter: a block's (stacked over layers) gets one per layer,
    with the layer index where HF names put it (`layers.3.mlp...`); any other, itself."""
    if path and path[0] == "layers":
        return [("layers", i, *path[1:]) for i in range(num_layers)]
    return [tuple(path)]


def hf_key(path: Sequence[object]) -> tuple[str, bool]:
    """The HF tensor name of one of our (per-layer) parameters, and whether it is stored
    transposed."""
    name = path_name(path)
    if name.startswith("lm_head."):
        return "lm_head.weight", True
    transpose = name.endswith(".kernel")
    if transpose:
        name = name[: -len(".kernel")] + ".weight"
    elif name == "embed_tokens":
        name = "embed_tokens.weight"
    return "model." + name, transpose


class SafetensorsCheckpoint:
    """The tensors of one checkpoint directory: model.safetensors or an indexed set of shards."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory)
        self._config = ModelConfig.from_file(self.path / "config.json")  # first: say what's missing
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise CheckpointError(f"{str(index)!r} is not a safetensors index: {err}") from None
            self.files = {key: self.path / name for key, name in weight_map.items()}
        elif single.is_file():
            with _open(single) as f:
                self.files = {key: single for key in f.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {str(self.path)!r}"
            )
        missing = sorted({str(p) for p in self.files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(
                f"safetensors shards listed in the index are missing: {missing}"
            )

    def config(self) -> ModelConfig:
        return self._config

    def names(self) -> list[str]:
        return list(self.files)

    def get(self, key: str) -> np.ndarray:
        if key not in self.files:
            raise KeyError(f"tensor {key!r} is not in the checkpoint at {str(self.path)!r}")
        with _open(self.files[key]) as f:
            return f.get_tensor(key)


def _open(path: Path) -> Any:
    """safe_open, with an error that names the file (a truncated download, say)."""
    try:
        return safe_open(path, framework="np")
    except OSError as err:
        raise CheckpointError(f"{str(path)!r} cannot be read: {err.strerror or err}") from None
    except SafetensorError as err:
        raise CheckpointError(
            f"{str(path)!r} is not a readable safetensors file ({err}); download or save it again"
        ) from None


def _lora_value(path: Sequence[object], shape: tuple[int, ...], dtype, seed: int) -> jax.Array:
    if path[-1] == "lora_b":
        return jnp.zeros(shape, dtype)
    key = jax.random.fold_in(jax.random.key(seed), zlib.crc32(path_name(path).encode()))
    # PEFT's kaiming-uniform(a=sqrt(5)) on fan_in: A is [in, r], or [adapters, in, r] stacked
    bound = 1.0 / shape[-2] ** 0.5
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def load_checkpoint(
    path: str | Path,
    *,
    dtype: jnp.dtype = jnp.bfloat16,
    lora: LoRAConfig | None = None,
    mesh: Mesh | None = None,
    lora_seed: int = 0,
) -> tuple[Decoder, HFTokenizer, tuple[int, ...]]:
    """What a policy needs from a checkpoint (a folder or a GGUF): the model, its tokenizer, its
    stop ids. A GGUF is parsed once for all three."""
    path = resolve_model_path(path)
    checkpoint = open_checkpoint(path)
    model = load_weights(checkpoint, dtype=dtype, lora=lora, mesh=mesh, lora_seed=lora_seed)
    no_tokenizer_files = not any((Path(path) / name).is_file() for name in TOKENIZER_FILES)
    if isinstance(checkpoint, GGUFCheckpoint) and no_tokenizer_files:
        tokenizer = checkpoint.tokenizer()
    else:
        tokenizer = load_tokenizer(path)
    return model, tokenizer, stop_token_ids(tokenizer, path)


def open_checkpoint(path: str | Path) -> SafetensorsCheckpoint | GGUFCheckpoint:
    """An HF folder (config.json and safetensors), or a GGUF: a .gguf file, or a folder whose
    weights are one (what `mmgrpo models fetch` writes), or a fetched registry model's name."""
    path = resolve_model_path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} is neither a folder nor a .gguf file")
    return SafetensorsCheckpoint(path)


def checkpoint_config(path: str | Path) -> ModelConfig:
    """The decoder shape of a checkpoint, read before (and without) its weights."""
    path = resolve_model_path(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file).config()
    return ModelConfig.from_file(path / "config.json")


def device_memory_bytes(device: jax.Device | None = None) -> int:
    """Memory of one accelerator, or the host's available RAM on CPU."""
    device = device or jax.devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(cfg: ModelConfig, dtype: jnp.dtype, path: str | Path, devices: int = 1) -> None:
    """Refuse, before reading any tensor, a checkpoint whose weights alone cannot fit."""
    need = cfg.num_params() * jnp.dtype(dtype).itemsize
    have = device_memory_bytes() * devices
    if need > have:
        raise MemoryError(
            f"{str(path)!r}: {cfg.num_params() / 1e9:.2f}B parameters need "
            f"{need / 2**30:.1f} GiB in {jnp.dtype(dtype).name} for the weights alone, more than "
            f"the {have / 2**30:.1f} GiB of {devices} {jax.devices()[0].platform} device(s); "
            "use a larger accelerator, more devices with a mesh, or a smaller checkpoint"
        )


def from_pretrained(
    path: str | Path,
    *,
    dtype: jnp.dtype = jnp.bfloat16,
    lora: LoRAConfig | None = None,
    mesh: Mesh | None = None,
    lora_seed: int = 0,
) -> Decoder:
    """A Decoder with the checkpoint's weights (cast to `dtype`) and a fresh LoRA adapter.

    `path` is an HF folder (config.json and safetensors) or a GGUF: a .gguf file, or a folder
    holding one (what `mmgrpo models fetch` writes), dequantized to `dtype`.

    Nothing is materialised twice: the model is built abstractly, then each tensor is read and
    placed on its devices (its shards only, with a mesh).
    """
    checkpoint = open_checkpoint(path)
    return load_weights(checkpoint, dtype=dtype, lora=lora, mesh=mesh, lora_seed=lora_seed)


def load_weights(
    checkpoint: SafetensorsCheckpoint | GGUFCheckpoint,
    *,
    dtype: jnp.dtype,
    lora: LoRAConfig | None,
    mesh: Mesh | None,
    lora_seed: int,
) -> Decoder:
    """from_pretrained on a checkpoint already open."""
    cfg = checkpoint.config()
    check_memory(cfg, dtype, checkpoint.path, devices=1 if mesh is None else mesh.size)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, lora=lora, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    used, loaded = set(), []
    for param_path, var in nnx.to_flat_state(state):
        shape, want_dtype = var.get_value().shape, var.get_value().dtype
        stacked = param_path[0] == "layers"  # one tensor per layer, stacked on the first axis
        per_layer = layer_paths(param_path, cfg.num_layers)
        one_shape = shape[1:] if stacked else shape
        if isinstance(var, nnx.LoRAParam):
            parts = [_lora_value(p, one_shape, want_dtype, lora_seed) for p in per_layer]
        elif isinstance(var, nnx.Param):
            parts = []
            for layer_path in per_layer:
                key, transpose = hf_key(layer_path)
                tensor = checkpoint.get(key)
                expected = one_shape[::-1] if transpose else one_shape
                if tensor.shape != expected:
                    raise ValueError(
                        f"tensor {key!r} has shape {tensor.shape}, expected {expected} for {cfg}"
                    )
                parts.append(np.asarray(tensor.T if transpose else tensor).astype(want_dtype))
                used.add(key)
        else:
            parts = None
        if parts is None:
            value = var.get_value()
        else:
            value = np.stack([np.asarray(p) for p in parts]) if stacked else parts[0]
        if mesh is not None:
            value = jax.device_put(value, param_sharding(param_path, shape, mesh))
        else:
            value = jnp.asarray(value)
        loaded.append((param_path, var.replace(value)))
    unused = [
        k
        for k in checkpoint.names()
        if k not in used
        and not k.endswith(IGNORED_SUFFIXES)
        and not (cfg.tie_word_embeddings and k == "lm_head.weight")
    ]
    if unused:
        raise ValueError(
            f"checkpoint tensors with no place in a {cfg.model_type} model: {unused[:8]}"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))
