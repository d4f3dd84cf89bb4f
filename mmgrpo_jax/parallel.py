"""A run's devices and processes: the mesh from the config, and what crosses process boundaries.

docs/design.md#scale. One (data, fsdp, tensor) mesh over every device of every process; training
rows split over data x fsdp, parameters by models.sharding's rules. Several processes are one
JAX runtime (`jax.distributed`): each samples its share of a step's examples with an engine on
its own devices, the step's trajectories are gathered to every process (so every process builds
the same batch and the update is one global step), and the trained parameters come back to each
process's engine as local arrays. Nothing here is a transport of its own: the gathers are JAX
collectives.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmgrpo_jax.config_files import setting
from mmgrpo_jax.errors import UserError, check_field_types
from mmgrpo_jax.errors import bad_field as _bad
from mmgrpo_jax.rl.batch import Batch
from models.sharding import BATCH, make_mesh, replicated, to_global

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The device mesh (docs/design.md#scale): training rows and sampler requests split over
    data x fsdp, parameters by the partition rules of models.sharding, heads over tensor."""

    data: int | None = setting(None, "null: every device the fsdp and tensor axes leave")
    fsdp: int = setting(1, "devices the weights and optimizer state are split over")
    tensor: int = setting(1, "devices each matmul is split over")
    devices: int | None = setting(None, "one process: run on its first N devices only; null: all")

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("fsdp", "tensor"):
            if getattr(self, name) < 1:
                raise _bad(self, name, "must be >= 1")
        for name in ("data", "devices"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise _bad(self, name, "must be >= 1 or null (all devices)")

    def mesh_shape(self, devices: int) -> tuple[int, int, int]:
        """(data, fsdp, tensor) over `devices` devices; refused if they do not multiply out."""
        inner = self.fsdp * self.tensor
        data = devices // inner if self.data is None else self.data
        if data < 1 or data * inner != devices:
            raise ValueError(
                f"ParallelConfig data={self.data} x fsdp={self.fsdp} x tensor={self.tensor} does "
                f"not cover the {devices} devices; choose sizes whose product is {devices}"
            )
        return data, self.fsdp, self.tensor

    @property
    def row_shards(self) -> int | None:
        """Into how many parts a batch of rows splits (data x fsdp), if known before the mesh."""
        return None if self.data is None else self.data * self.fsdp


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Several processes (hosts) as one JAX runtime (`jax.distributed.initialize`); empty = one
    process. Every process runs the same command with its own process_id."""

    coordinator_address: str | None = setting(None, "host:port of process 0")
    num_processes: int = 1
    process_id: int = setting(0, "this process's index, 0 .. num_processes - 1")
    heartbeat_timeout_s: int = setting(
        100,
        (
            "seconds without a heartbeat after which the runtime declares a process dead "
            "and the others exit with an error (instead of waiting in a collective for "
            "ever)"
        ),
    )
    initialization_timeout_s: int = setting(300, "seconds to wait for every process to join")

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.num_processes < 1:
            raise _bad(self, "num_processes", "must be >= 1")
        if not 0 <= self.process_id < self.num_processes:
            raise _bad(self, "process_id", f"must be in [0, num_processes={self.num_processes})")
        if self.num_processes > 1 and not self.coordinator_address:
            raise _bad(self, "coordinator_address", "must be host:port when num_processes > 1")
        if self.coordinator_address:
            self._coordinator()  # refuses what is not host:port before a device is touched
        for name in ("heartbeat_timeout_s", "initialization_timeout_s"):
            if getattr(self, name) < 1:
                raise _bad(self, name, "must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1

    @property
    def coordinator_host(self) -> str:
        """The host of `coordinator_address` (an IPv6 host without its brackets)."""
        return self._coordinator()[0]

    @property
    def coordinator_port(self) -> int:
        return self._coordinator()[1]

    def _coordinator(self) -> tuple[str, int]:
        """`coordinator_address` as (host, port): host:port, an IPv6 host in brackets."""
        host, colon, port = (self.coordinator_address or "").rpartition(":")
        if not colon or not host or host in ("[", "[]"):
            raise _bad(self, "coordinator_address", "must be host:port, e.g. 10.0.0.1:1234")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _bad(self, "coordinator_address", "must have a port in 1-65535")
        return host.strip("[]"), int(port)


class JoinTimeout(UserError):
    """Processes of the run that never joined within `initialization_timeout_s`."""


JOIN_REPORT_EVERY_S = 10.0  # a progress line while the processes gather
# the runtime's own deadline comes after ours, so that ours (a clear line) is what the user gets
# and not the runtime's abort
_RUNTIME_MARGIN_S = 60
JOIN_THREAD = "mmgrpo-join"  # the thread the runtime's join blocks in


def initialize(config: DistributedConfig) -> None:
    """Join the runtime of `config.num_processes` processes (nothing for one process). Must run
    before anything touches a device; a process that dies stops the others within the heartbeat
    timeout, with an error, instead of leaving them in a collective.

    The runtime's join blocks in C++ (no signal gets through, and at its deadline it aborts the
    process), so it runs in a thread while this one waits: a progress line every
    JOIN_REPORT_EVERY_S, SIGINT / SIGTERM raise as anywhere else, and at
    `initialization_timeout_s` a JoinTimeout says which processes never came."""
    if not config.enabled:
        return
    if jax.distributed.is_initialized():
        return
    # CPU devices of different processes talk through gloo (accelerators use their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    failures: list[BaseException] = []

    def join() -> None:
        try:
            jax.distributed.initialize(
                coordinator_address=config.coordinator_address,
                num_processes=config.num_processes,
                process_id=config.process_id,
                initialization_timeout=config.initialization_timeout_s + _RUNTIME_MARGIN_S,
                heartbeat_timeout_seconds=config.heartbeat_timeout_s,
            )
        except BaseException as err:  # handed to the waiting thread
            failures.append(err)

    joining = threading.Thread(target=join, name=JOIN_THREAD, daemon=True)
    joining.start()
    _wait_for_join(joining, time.monotonic(), config)  # a timeout or a signal leaves it blocked
    if failures:
        raise failures[0]
    logger.info(
        "process %d of %d joined %s: %d local, %d global devices",
        jax.process_index(),
        jax.process_count(),
        config.coordinator_address,
        jax.local_device_count(),
        jax.device_count(),
    )


def _wait_for_join(joining: threading.Thread, started: float, config: DistributedConfig) -> None:
    """Wait in Python (where signals get through), saying how long, up to the timeout."""
    deadline = started + config.initialization_timeout_s
    while joining.is_alive():
        try:
            joining.join(timeout=max(min(JOIN_REPORT_EVERY_S, deadline - time.monotonic()), 0.0))
        except KeyboardInterrupt as err:  # SIGINT, or SIGTERM under StopSignals
            err.add_note(
                f"while waiting for the {config.num_processes} processes of the run to join at "
                f"{config.coordinator_address}: nothing had started"
            )
            raise
        if not joining.is_alive():
            break
        now = time.monotonic()
        if now >= deadline:
            raise JoinTimeout(_never_joined(config, now - started))
        logger.warning("%s", _waiting(config, now - started))


def join_abandoned() -> bool:
    """Whether a join was given up (timeout, signal) with the runtime still blocked in its
    thread: the process must then leave without the interpreter's teardown, which would wait
    on that runtime and print its shutdown errors (cli.entry)."""
    return any(thread.name == JOIN_THREAD for thread in threading.enumerate())


def _coordinator_is_up(config: DistributedConfig) -> bool:
    """Whether process 0's coordination service accepts connections (a plain TCP probe)."""
    address = (config.coordinator_host, config.coordinator_port)
    try:
        with socket.create_connection(address, timeout=1.0):
            return True
    except OSError:
        return False


def _waiting(config: DistributedConfig, waited: float) -> str:
    me, n = config.process_id, config.num_processes
    where = (
        "this process hosts the coordinator"
        if me == 0
        else f"the coordinator (process 0) is {'up' if _coordinator_is_up(config) else 'not up'}"
    )
    return (
        f"waiting for the {n} processes of the run at {config.coordinator_address} (this is "
        f"process {me}; {where}): {waited:.0f} s of distributed.initialization_timeout_s="
        f"{config.initialization_timeout_s}"
    )


def _never_joined(config: DistributedConfig, waited: float) -> str:
    """Which processes never joined, as far as this one can tell: the runtime reports nobody's
    arrival before all have arrived, so only the coordinator's presence can be probed."""
    me, n = config.process_id, config.num_processes
    others = [p for p in range(1, n) if p != me]  # the processes besides this one and 0
    if me != 0 and not _coordinator_is_up(config):
        missing = "process 0 (the coordinator) never came up"
        if others:
            missing += f"; of processes {others} the runtime cannot say"
    elif n == 2:
        missing = f"process {1 - me} never joined"
    else:
        missing = f"some of processes {others} never joined (the runtime does not say which)"
    return (
        f"distributed: {missing} within {waited:.0f} s at {config.coordinator_address} (this is "
        f"process {me} of {n}); start every process with the same coordinator_address and "
        "num_processes and its own process_id, or raise distributed.initialization_timeout_s"
    )


def run_mesh(config: ParallelConfig) -> Mesh:
    """The run's mesh over every device of every process (device order: process by process),
    or over the first `config.devices` of a single process."""
    devices = jax.devices()
    if config.devices is not None:
        if jax.process_count() > 1:
            raise ValueError(
                f"ParallelConfig.devices={config.devices} selects devices of one process; a run "
                f"of {jax.process_count()} processes uses all of theirs (leave it null)"
            )
        if config.devices > len(devices):
            raise ValueError(
                f"ParallelConfig.devices={config.devices}, but this host has {len(devices)}"
            )
        devices = devices[: config.devices]
    return make_mesh(config.mesh_shape(len(devices)), devices)


def place_batch(batch: Batch, mesh: Mesh) -> Batch:
    """A step's batch on the mesh: every [A, rows, ...] field split over data x fsdp along its
    rows, the [A] normalisers replicated. Every process passes the same (whole) batch."""

    def place(x: Any) -> jax.Array:
        spec = P(None, BATCH) if np.ndim(x) >= 2 else P()
        return to_global(np.asarray(x), NamedSharding(mesh, spec))

    return jax.tree.map(place, batch)


def place_replicated(tree: T, mesh: Mesh) -> T:
    """Every leaf that is not already on `mesh` (optimizer counters, keys) replicated onto it;
    leaves placed by the partition rules stay as they are."""

    def place(x: Any) -> Any:
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
            return x
        return to_global(x, replicated(mesh))

    return jax.tree.map(place, tree)


def shardings_of(tree: T) -> T:
    return jax.tree.map(lambda x: x.sharding, tree)


def local_copy(tree: T) -> T:
    """Arrays this process holds whole: a global array's local replica, or (split over several
    processes) its gathered value. A collective when any leaf is split across processes: every
    process must call it, in the same order."""

    def local(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.sharding.is_fully_replicated:
            return x.addressable_data(0)
        return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(local, tree)


def share(items: Sequence[T], process: int | None = None, count: int | None = None) -> range:
    """The indices of `items` that process `process` of `count` takes: a contiguous block,
    the first processes taking one more when they do not divide evenly."""
    process = jax.process_index() if process is None else process
    count = jax.process_count() if count is None else count
    size, extra = divmod(len(items), count)
    start = process * size + min(process, extra)
    return range(start, start + size + (process < extra))


def gather_lists(local: list[T]) -> list[T]:
    """Every process's `local` items (picklable), concatenated in process order; a collective."""
    if jax.process_count() == 1:
        return list(local)
    data = np.frombuffer(pickle.dumps(local), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int64))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    everyone = multihost_utils.process_allgather(padded)
    return [
        item
        for i, n in enumerate(sizes.reshape(-1))
        for item in pickle.loads(everyone[i, : int(n)].tobytes())  # this run's processes' bytes
    ]


def any_signal(signum: int | None) -> int | None:
    """The signal some process holds back (the highest number), on every process: all of
    them stop at the same step boundary, so their collectives stay in step (a collective
    called by only some processes would wait for ever: both sides are alive)."""
    if jax.process_count() == 1:
        return signum
    everyone = multihost_utils.process_allgather(np.asarray([signum or 0], np.int64))
    return int(everyone.max()) or None


def process_zero_says(flag: bool) -> bool:
    """Process 0's `flag` on every process (a collective): a decision that steers collectives
    after it (skip an evaluation, stop a finished run) is taken once, not by each process
    reading shared files on its own."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def is_main_process() -> bool:
    """Process 0 writes the logs, checkpoint metadata and the adapter."""
    return jax.process_index() == 0
