"""Multi-process runs on jax's own runtime (`jax.distributed`): one process per host (or per GPU),
the same SPMD program in each, over one global mesh.

A run becomes multi-process when `--coordinator ADDR --num-processes N --process-id I` are given,
or the environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID are
set, or `--coordinator auto` asks jax to detect a cluster (Slurm, Open MPI, Cloud TPU). Nothing
here launches processes: the same command runs on every host.

What changes against one process, and where:
  * the mesh is global, its devices ordered by process (`process_devices`), so a "tp" group of
    consecutive devices never leaves a host and "dp" runs across hosts;
  * arrays are made from host data with `jax.make_array_from_callback`: each process fills only
    the shards its own devices hold (`put_rows` reads only this process's rows of a batch);
  * host values come back from replicated arrays through a local shard (`to_host`): a global
    array with devices on other hosts cannot be fetched whole;
  * only process 0 (`is_main`) writes logs, plots and exports; every process takes part in the
    collectives and in orbax's checkpoint saves and restores.
CPU runs use gloo collectives, so a multi-process run works on CI machines without accelerators.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

ENV_ADDRESS, ENV_PROCESSES, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
AUTO = "auto"  # --coordinator auto: jax's own cluster detection


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process sits in a multi-process run. coordinator "auto" leaves the three to jax."""

    coordinator: str
    num_processes: int | None
    process_id: int | None


def cluster_from(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
                 environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster that the flags (first) or the JAX_* environment variables describe; None for one process.

    Raises one ValueError naming the flag or variable when the description is incomplete or
    inconsistent (a process id outside 0..N-1, a count below 1, a count without an address).
    """
    env = os.environ if environ is None else environ

    def pick(given: Any, var: str, flag: str, parse: Callable[[str], Any]) -> Any:
        if given is not None:
            return given
        if env.get(var, "").strip():
            try:
                return parse(env[var].strip())
            except ValueError:
                raise ValueError(f"{var}={env[var]!r} is not valid for {flag}") from None
        return None

    address = pick(coordinator, ENV_ADDRESS, "--coordinator", str)
    count = pick(num_processes, ENV_PROCESSES, "--num-processes", int)
    pid = pick(process_id, ENV_ID, "--process-id", int)
    if address is None:
        if count is not None or pid is not None:
            raise ValueError(f"--num-processes / --process-id ({ENV_PROCESSES} / {ENV_ID}) need --coordinator "
                             f"ADDR:PORT ({ENV_ADDRESS}), the address of process 0")
        return None
    # Checked for "auto" too: what is given there overrides jax's detection.
    if count is not None and count < 1:
        raise ValueError(f"--num-processes ({ENV_PROCESSES}) must be >= 1, got {count}")
    if pid is not None and (pid < 0 or (count is not None and pid >= count)):
        span = f"in 0..{count - 1} for {count} processes" if count is not None else ">= 0"
        raise ValueError(f"--process-id ({ENV_ID}) must be {span}, got {pid}")
    if address == AUTO:
        return Cluster(AUTO, count, pid)
    if ":" not in address:
        raise ValueError(f"--coordinator ({ENV_ADDRESS}) must be HOST:PORT of process 0, got {address!r}")
    if count is None or pid is None:
        raise ValueError(f"--coordinator {address} needs --num-processes N and --process-id I "
                         f"({ENV_PROCESSES}, {ENV_ID}); or pass --coordinator auto on a cluster jax detects")
    return Cluster(address, count, pid)


def initialize(cluster: Cluster | None) -> None:
    """Joins the multi-process run (a no-op for None). Must run before anything touches a device.

    Waits until every process has joined (jax's own timeout, 5 minutes, names the missing ones).
    """
    if cluster is None:
        return
    # Cross-process collectives on CPU devices; GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cluster.coordinator == AUTO:
        jax.distributed.initialize(num_processes=cluster.num_processes, process_id=cluster.process_id)
    else:
        jax.distributed.initialize(cluster.coordinator, cluster.num_processes, cluster.process_id)


def is_main() -> bool:
    """True in the process that writes logs, plots, exports and answers (process 0)."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


def process_devices() -> list[Any]:
    """Every device of the run ordered by (process, id): consecutive devices share a host."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def barrier(name: str) -> None:
    """Waits until every process reaches the barrier `name` (a no-op in one process)."""
    if multi_process():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def agree(value: int) -> int:
    """Process 0's `value` in every process: decisions taken from a clock (a time limit) must agree."""
    if not multi_process():
        return value
    from jax.experimental import multihost_utils

    return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def put_replicated(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Every array of `tree` whole on every device of `mesh` (the same value in every process)."""
    sharding = NamedSharding(mesh, PartitionSpec())
    return put_sharded(tree, jax.tree.map(lambda _: sharding, tree))


def put_sharded(tree: Any, shardings: Any) -> Any:
    """Every array of `tree` laid out as the matching leaf of `shardings` says (the same value in
    every process): each process fills only the shards its own devices hold."""
    def one(x: Any, sharding: NamedSharding) -> jax.Array:
        if isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding == sharding):
            return jax.device_put(x, sharding)  # already global or in place: a relayout at most
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def put_rows(rows: Callable[[np.ndarray], Mapping[str, np.ndarray]], count: int, mesh: jax.sharding.Mesh,
             sharding_of: Callable[[tuple[int, ...]], NamedSharding], shapes: Mapping[str, tuple[int, ...]]
             ) -> dict[str, jax.Array]:
    """A global batch of `count` rows, its leading axis split as `sharding_of(shape)` says.

    rows(indices) -> {name: [len(indices), ...]} gives rows of the global batch; it is called only
    for the rows this process's devices hold, once per distinct slice. `shapes` are the global shapes.
    """
    cache: dict[tuple[int, int], Mapping[str, np.ndarray]] = {}

    def part(start: int, stop: int) -> Mapping[str, np.ndarray]:
        if (start, stop) not in cache:
            cache[(start, stop)] = rows(np.arange(start, stop))
        return cache[(start, stop)]

    out = {}
    for name, shape in shapes.items():
        def fill(index: tuple[slice, ...], name: str = name) -> np.ndarray:
            lead = index[0].indices(count)
            return np.asarray(part(lead[0], lead[1])[name])[(slice(None),) + tuple(index[1:])]

        out[name] = jax.make_array_from_callback(shape, sharding_of(shape), fill)
    return out


def to_host(tree: Any) -> Any:
    """numpy copies of every array of `tree`; a global array must be replicated (read from a local shard)."""
    def one(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return jax.device_get(x)
        if not x.is_fully_replicated:
            raise ValueError(f"to_host: an array of shape {x.shape} is split across processes; replicate it first")
        return np.asarray(x.addressable_data(0))

    return jax.tree.map(one, tree)


def gather_json(items: Sequence[Any]) -> list[Any]:
    """Every process's JSON-able `items`, concatenated in process order, in every process.

    Two collectives: the byte lengths, then the bytes padded to the longest. One process: `items`.
    """
    if not multi_process():
        return list(items)
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(list(items)).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(data)))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(data)] = data
    every = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    out: list[Any] = []
    for row, n in zip(every, lengths):
        out.extend(json.loads(row[:int(n)].tobytes().decode()))
    return out


def ordered_sum(tree: Any, axis: str, size: int) -> Any:
    """The sum over mesh axis `axis` (of `size` devices) of every array of `tree`, inside a shard_map,
    added in an order fixed here: the same bits however the devices are spread over processes.

    XLA's all-reduce adds in an order its collectives implementation picks (in-process CPU, gloo,
    NCCL differ), so a run over one set of devices would change in the last bits when its
    processes change. Here only exact data moves cross devices: at a power of two, recursive
    doubling (partners i and i ^ d swap partial sums, d = 1, 2, 4, ...; a + b == b + a exactly,
    so both partners hold the same bits); otherwise an all-gather, then a local sum in device order.
    """
    if size == 1:
        return tree
    if size & (size - 1):
        return jax.tree.map(lambda x: jax.numpy.sum(jax.lax.all_gather(x, axis), axis=0), tree)
    d = 1
    while d < size:
        perm = [(i, i ^ d) for i in range(size)]
        tree = jax.tree.map(lambda x, perm=perm: x + jax.lax.ppermute(x, axis, perm), tree)
        d *= 2
    return tree
