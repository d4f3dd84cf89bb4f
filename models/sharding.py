"""Partition rules for every parameter (LoRA included) and the KV cache on a 3-axis mesh.

Column-parallel projections (q, k, v, gate, up, lm_head) split their output over `tensor` and their
input over `fsdp`; row-parallel ones (o, down) the reverse; LoRA factors follow their layer; norms
are replicated; the batch of activations and caches splits over (data, fsdp).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")
_COLUMN = r"(q_proj|k_proj|v_proj|gate_proj|up_proj)"
_ROW = r"(o_proj|down_proj)"
RULES: tuple[tuple[str, P], ...] = (
    (r"^embed_tokens$", P("tensor", "fsdp")),
    (r"^lm_head\.kernel$", P("fsdp", "tensor")),
    (rf"\.{_COLUMN}\.kernel$", P("fsdp", "tensor")),
    (rf"\.{_ROW}\.kernel$", P("tensor", "fsdp")),
    (rf"\.{_COLUMN}\.bias$", P("tensor")),
    (rf"\.{_COLUMN}\.lora_a$", P("fsdp", None)),
    (rf"\.{_COLUMN}\.lora_b$", P(None, "tensor")),
    (rf"\.{_ROW}\.lora_a$", P("tensor", None)),
    (rf"\.{_ROW}\.lora_b$", P(None, "fsdp")),
    (r"norm\.weight$", P()),
)


def make_mesh(
    shape: Sequence[int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (data, fsdp, tensor) mesh; by default every device on the fsdp axis."""
    devices = list(devices if devices is not None else jax.devices())
    shape = tuple(shape) if shape is not None else (1, len(devices), 1)
    if len(shape) != 3 or int(np.prod(shape)) != len(devices):
        raise ValueError(
            f"mesh shape {shape} must have 3 axes {AXES} covering {len(devices)} devices"
        )
    return Mesh(np.asarray(devices).reshape(shape), AXES)


def path_name(path: Sequence[object]) -> str:
    return ".".join(str(p) for p in path)


def param_spec(path: Sequence[object]) -> P:
    """The rule's spec; a block's parameter (stacked over layers) keeps its layer axis whole."""
    name = path_name(path)
    for pattern, spec in RULES:
        if re.search(pattern, name):
            return P(None, *spec) if path and path[0] == "layers" else spec
    raise ValueError(f"no partition rule for parameter {name!r}; add one to models.sharding.RULES")


def _checked(name: str, shape: Sequence[int], spec: P, mesh: Mesh) -> NamedSharding:
    for dim, axes in zip(shape, spec, strict=False):
        if axes is None:
            continue
        size = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
        if dim % size:
            raise ValueError(
                f"{name}: dimension {dim} of shape {tuple(shape)} does not divide over mesh axes "
                f"{axes} of size {size}"
            )
    return NamedSharding(mesh, spec)


def param_sharding(path: Sequence[object], shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    spec = param_spec(path)
    if path and path[-1] in ("lora_a", "lora_b") and len(shape) == len(spec) + 1:
        spec = P(*spec[:-2], None, *spec[-2:])  # stacked adapters: the adapter axis stays whole
    return _checked(path_name(path), shape, spec, mesh)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """A NamedSharding for every leaf of a model state, same tree structure."""
    flat = nnx.to_flat_state(state)
    shardings = [
        (path, var.replace(param_sharding(path, var.get_value().shape, mesh))) for path, var in flat
    ]
    return nnx.from_flat_state(shardings)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Place every parameter of `model` on `mesh` by the rules (in place)."""
    nnx.update(model, placed_state(nnx.state(model), mesh))
    return model


def placed_state(state: nnx.State, mesh: Mesh) -> nnx.State:
    """`state` placed on `mesh` by the rules (see `to_global` for several processes)."""
    return jax.tree.map(to_global, state, state_shardings(state, mesh))


def to_global(x: jax.Array | np.ndarray, sharding: NamedSharding) -> jax.Array:
    """`x` as an array with `sharding`, on one process or several.

    With several processes the mesh spans devices this process cannot address: each process
    passes the same value (a host array, or an array on one of its devices) and supplies its
    own devices' shards; a shard on the device `x` already lives on is `x`'s buffer, not a copy
    (a host's frozen base weights are then held once for its engine and its training shard).
    """
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    home = next(iter(x.devices())) if isinstance(x, jax.Array) and len(x.devices()) == 1 else None
    whole = tuple(slice(None) for _ in x.shape)
    shards = [
        x if device == home and index == whole else jax.device_put(x[index], device)
        for device, index in sharding.addressable_devices_indices_map(x.shape).items()
    ]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """KV cache, keys [layers, B, K, Dh, S] and values [layers, B, K, S, Dh]: B over (data,
    fsdp), K over tensor."""
    return NamedSharding(mesh, P(None, BATCH, "tensor", None, None))


def batch_multiple(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]
