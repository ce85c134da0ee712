"""Tensor and data parallelism with `jax.sharding`: the mesh, placement rules, and sharded kernels.

The mesh has two axes, `("dp", "tp")`: `dp` splits the batch, `tp` splits the model (Megatron
style). Model code never names a device: it names *logical* axes (`params.VOCAB`, `Q_HEADS`, ...),
and one rule table (`params.TENSOR_PARALLEL`, plus `BATCH -> "dp"` for activations) maps them
to mesh axes. With no mesh active every helper here is a no-op, so the single-device API is
unchanged; with a mesh active (`with use_mesh(mesh):` around tracing) the same code runs as
one SPMD program over all devices.

Layout at tp = N:
  * q/k/v projections are column-parallel (split over heads), `o_proj` row-parallel;
  * gate/up are column-parallel (split over the MLP intermediate axis), `down` row-parallel;
    XLA's SPMD partitioner inserts one all-reduce after `o_proj` and one after `down`;
  * embedding and LM head are vocab-parallel: the lookup is a masked local gather + one
    all-reduce (`embed_lookup`); logits stay sharded over the vocabulary, and argmax / top-k /
    sampling over them are exact (the partitioned reductions carry indices; threefry random
    bits do not depend on the sharding);
  * norms and the residual stream are replicated over tp; everything with a batch axis is
    split over dp;
  * the KV caches (target and drafter) are split by KV head over tp and by sequence over dp;
  * attention runs under `jax.shard_map` over (dp, tp), so the Pallas kernel sees one shard's
    heads and sequences (a `pallas_call` cannot be auto-partitioned).

Divisibility rules (`partition_spec`), decided per tensor dimension from its size:
  * q heads and the MLP intermediate size must divide by tp: otherwise a `ShardingError`
    naming the numbers;
  * kv heads: split when kv_heads % tp == 0; when instead tp % kv_heads == 0 (e.g. 2 kv heads
    at tp = 4) the KV projections and the KV cache are deliberately REPLICATED over tp and each
    device's attention uses the one KV head its query heads need (vLLM's rule). Any other
    combination is a `ShardingError`;
  * vocab: split when vocab % tp == 0, otherwise replicated (costs memory, not correctness);
  * batch: split over dp when batch % dp == 0, otherwise replicated.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.params import (KV_HEADS, TENSOR_PARALLEL, VOCAB, ShardingRules, Spec, is_spec, path_str)

DP, TP = "dp", "tp"
# Logical axis of activations' batch dimension (weights have none).
BATCH = "batch"
ACTIVATION_RULES = ShardingRules(TENSOR_PARALLEL.rules + ((BATCH, DP),))


class ShardingError(ValueError):
    """A model cannot be laid out on a mesh (e.g. q heads not divisible by tp)."""


# ----------------------------------------------------------------------------- the mesh

def make_mesh(dp: int = 1, tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ("dp", "tp") mesh over the first dp * tp devices (Auto axes: XLA propagates shardings).

    Within a dp row the tp devices are consecutive, so on one host the tp group shares the
    fastest links.
    """
    if dp < 1 or tp < 1:
        raise ShardingError(f"dp and tp must be >= 1, got dp={dp}, tp={tp}")
    devices = list(jax.devices() if devices is None else devices)
    if dp * tp > len(devices):
        raise ShardingError(f"a dp={dp} x tp={tp} mesh needs {dp * tp} devices, but only "
                            f"{len(devices)} are available ({jax.default_backend()})")
    grid = np.array(devices[:dp * tp], dtype=object).reshape(dp, tp)
    return Mesh(grid, (DP, TP), axis_types=(AxisType.Auto, AxisType.Auto))


def use_mesh(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """Context in which model code is traced sharded over `mesh` (None: a no-op context).

    Jitted functions retrace per mesh (the mesh is part of jax's trace context), so the same
    jitted decoder serves one device and many. The mesh's axes must be Auto (as `make_mesh`
    makes them): the model relies on XLA propagating shardings between the constraints.
    """
    if mesh is None:
        return contextlib.nullcontext()
    if any(t != AxisType.Auto for t in getattr(mesh, "axis_types", ())):
        raise ShardingError(f"use_mesh needs a mesh with Auto axes (dflash_jax.sharding.make_mesh); got "
                            f"axis types {mesh.axis_types} (jax.make_mesh defaults to Explicit)")
    return jax.sharding.set_mesh(mesh)


def active_mesh() -> Any | None:
    """The mesh model code is being traced under, or None.

    None also when the mesh names neither "dp" nor "tp", or when those axes are already manual
    (inside a `shard_map` over them): then there is nothing left for us to partition.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    manual = set(getattr(mesh, "manual_axes", ()))
    if not any(a in mesh.axis_names and a not in manual for a in (DP, TP)):
        return None
    return mesh


def _axis_size(mesh: Any, axis: str) -> int:
    if mesh is None or axis not in mesh.axis_names or axis in set(getattr(mesh, "manual_axes", ())):
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[axis])


def mesh_sizes(mesh: Any | None = None) -> tuple[int, int]:
    """(dp, tp) of `mesh` (default: the active one); (1, 1) without a mesh."""
    mesh = active_mesh() if mesh is None else mesh
    return _axis_size(mesh, DP), _axis_size(mesh, TP)


# ----------------------------------------------------------------------------- the rules

def kv_heads_sharded(kv_heads: int, tp: int) -> bool:
    """True: KV heads split over tp; False: replicated (tp a multiple of kv_heads); else raises."""
    if kv_heads % tp == 0:
        return True
    if tp % kv_heads == 0:
        return False
    raise ShardingError(f"kv_heads={kv_heads} cannot be laid out over tp={tp}: tp must divide the "
                        f"KV heads (split them) or be a multiple of them (replicate them); use a tp "
                        f"among {_good_tps(kv_heads)}")


def _good_tps(kv_heads: int) -> list[int]:
    return [t for t in range(1, 2 * kv_heads + 1) if kv_heads % t == 0 or t % kv_heads == 0][:8]


def _mesh_axis_for(logical: str | None, size: int, mesh_axis: str | None, n: int, what: str) -> str | None:
    """Applies the divisibility rules of the module docstring to one dimension."""
    if mesh_axis is None or n == 1 or size % n == 0:
        return mesh_axis if n > 1 else None
    if logical == KV_HEADS:
        try:
            kv_heads_sharded(size, n)  # raises unless tp is a multiple of the kv heads
        except ShardingError as err:
            raise ShardingError(f"{what}: {err}") from None
        return None
    if logical in (VOCAB, BATCH):
        return None
    raise ShardingError(f"{what}: {logical} = {size} is not divisible by {mesh_axis}={n}; "
                        f"choose a {mesh_axis} that divides {size}")


def partition_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Any,
                   rules: ShardingRules = ACTIVATION_RULES, what: str = "tensor") -> P:
    """The PartitionSpec of a tensor with these logical axes and shape on `mesh`."""
    out = []
    for logical, size, mesh_axis in zip(axes, shape, rules.mesh_axes(tuple(axes))):
        out.append(_mesh_axis_for(logical, int(size), mesh_axis, _axis_size(mesh, mesh_axis)
                                  if mesh_axis else 1, what))
    return P(*out)


def check_model(cfg: Any, tp: int) -> None:
    """Raises a ShardingError naming the numbers when `cfg` (target or drafter) cannot use `tp`."""
    if tp == 1:
        return
    name = type(cfg).__name__
    if cfg.num_heads % tp:
        raise ShardingError(f"{name}: num_heads={cfg.num_heads} (query heads) is not divisible by tp={tp}")
    kv_heads_sharded(cfg.num_kv_heads, tp)
    if cfg.intermediate_size % tp:
        raise ShardingError(f"{name}: intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")


# ----------------------------------------------------------------------------- placement

def spec_sharding(spec: Spec, mesh: Mesh, rules: ShardingRules = TENSOR_PARALLEL, what: str = "tensor"
                  ) -> NamedSharding:
    """NamedSharding of one declared weight (replicated over dp)."""
    return NamedSharding(mesh, partition_spec(spec.axes, spec.shape, mesh, rules, what))


def placement(mesh: Mesh, rules: ShardingRules = TENSOR_PARALLEL):
    """A `(dotted.path, Spec) -> NamedSharding` callable: where `params.Builder` (the loaders)
    puts each decoding tensor once it is filled; a device only ever receives its own slice."""
    return lambda path, spec: spec_sharding(spec, mesh, rules, what=path)


def specs_shardings(specs: Any, mesh: Mesh, rules: ShardingRules = TENSOR_PARALLEL) -> Any:
    """A tree of NamedShardings matching a Spec tree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return jax.tree_util.tree_unflatten(treedef, [spec_sharding(s, mesh, rules, path_str(p)) for p, s in flat])


def cache_sharding(mesh: Mesh, batch: int, kv_heads: int) -> NamedSharding:
    """[batch, max_len, kv_heads, head_dim] cache buffers: batch over dp, KV heads over tp."""
    return NamedSharding(mesh, partition_spec((BATCH, None, KV_HEADS, None), (batch, 1, kv_heads, 1), mesh))


def batch_sharding(mesh: Mesh, shape: Sequence[int]) -> NamedSharding:
    """An array whose leading axis is the batch: split over dp, the rest replicated."""
    axes = (BATCH,) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, partition_spec(axes, shape, mesh)) if len(shape) else NamedSharding(mesh, P())


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """Shardings for a decode state (e.g. `speculative.SpecState`, a `KVCache`, prompts).

    KV buffers (4-D leaves of any `k`/`v` field) by kv head and batch; other arrays whose
    leading axis is the batch over dp; PRNG keys and scalars replicated.
    """
    batch = _batch_of(state)

    def one(path: tuple, leaf: Any) -> NamedSharding:
        name = getattr(path[-2], "name", None) if len(path) >= 2 else None
        shape = tuple(leaf.shape)
        if name in ("k", "v") and len(shape) == 4:
            return cache_sharding(mesh, shape[0], shape[2])
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key) or not shape or shape[0] != batch:
            return NamedSharding(mesh, P())
        return batch_sharding(mesh, shape)

    return jax.tree_util.tree_map_with_path(one, state)


def _batch_of(state: Any) -> int | None:
    for leaf in jax.tree.leaves(state):
        if getattr(leaf, "ndim", 0) >= 1 and not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return int(leaf.shape[0])
    return None


# ----------------------------------------------------------------------------- inside model code

# Largest row-parallel result (bytes) all-reduced in one op while tracing; None: no limit.
_all_reduce_max_bytes: int | None = None


@contextlib.contextmanager
def all_reduce_max_bytes(limit: int | None):
    """While tracing in this context, row-parallel results over `limit` bytes are all-reduced
    in row chunks of at most `limit` bytes each (`row_parallel_chunks`).

    Why: XLA's own all-reduce kernel (`xla_gpu_unsupported_use_all_reduce_one_shot_kernel`)
    takes inputs up to 2 MB only; a DDTree(256) verify of a 5120-wide model all-reduces 2.8 MB
    per op, which would otherwise fall back to NCCL. Compile such programs with
    `xla_gpu_all_reduce_combine_threshold_bytes=0`, or XLA combines the chunks again. Programs
    already traced keep the chunking they were traced with.
    """
    global _all_reduce_max_bytes
    if limit is not None and limit < 1:
        raise ValueError(f"all_reduce_max_bytes: limit must be >= 1 byte or None, got {limit}")
    old, _all_reduce_max_bytes = _all_reduce_max_bytes, limit
    try:
        yield
    finally:
        _all_reduce_max_bytes = old


def row_parallel_chunks(rows: int, batch: int, row_bytes: int) -> list[int]:
    """Row counts of the chunks a [batch, rows, out] row-parallel result is all-reduced in.

    `row_bytes` is one row of one sequence; a device all-reduces its dp shard of the batch.

    One chunk without a mesh, at tp = 1, with no limit set, or when the result fits the limit;
    otherwise the fewest near-equal chunks that each fit (a single row is never split).
    """
    limit = _all_reduce_max_bytes
    dp, tp = mesh_sizes()
    total = rows * row_bytes * (batch // dp if batch % dp == 0 else batch)
    if limit is None or tp == 1 or total <= limit:
        return [rows]
    n = -(-total // limit)
    while n < rows and -(-rows // n) * total > limit * rows:  # the largest chunk must fit too
        n += 1
    n = min(n, rows)
    return [rows // n + (i < rows % n) for i in range(n)]


# Row groups of each decoder layer's work after attention, while tracing; see `overlap_row_groups`.
_row_groups: int = 1


@contextlib.contextmanager
def overlap_row_groups(groups: int):
    """While tracing in this context under tp > 1, each target decoder layer's work after
    attention (o_proj and its all-reduce, the MLP and its all-reduce) runs as `groups`
    independent groups of rows (`row_groups`).

    Why: at batch 1 each all-reduce costs ~20 us however small, and at tp = 2 the 32B shape's
    DDTree(256) round spends 3.2 ms per GPU in them on H200s. One row
    group's all-reduce does not depend on the next group's products, so an async collective
    can run while they compute, if the compiler schedules it that way. The benchmark variant
    `bench.collectives.ALL_REDUCE["nccl-overlap"]` turns on XLA's latency-hiding scheduler and
    turns off the all-reduce combiner, which would join the groups' all-reduces again. Exact:
    after attention the rows do not interact. Programs already traced keep their grouping.
    """
    global _row_groups
    if groups < 1:
        raise ValueError(f"overlap_row_groups: groups must be >= 1, got {groups}")
    old, _row_groups = _row_groups, groups
    try:
        yield
    finally:
        _row_groups = old


def row_groups(rows: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of near-equal row groups for a layer's post-attention work.

    One range without a mesh, at tp = 1, outside `overlap_row_groups`, or with fewer rows than
    groups.
    """
    groups = _row_groups
    if groups == 1 or mesh_sizes()[1] == 1 or rows < groups:
        return [(0, rows)]
    bounds = [rows * g // groups for g in range(groups + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Lays an activation out by its logical axes on the active mesh; a no-op without one."""
    mesh = active_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, partition_spec(axes, x.shape, mesh))


def replicate(tree: Any) -> Any:
    """Lays every array of `tree` out whole on every device of the active mesh; a no-op without one.

    Why: in a data-parallel train step the new parameters and optimizer state must come out
    replicated (each device's copy equal), whatever layout XLA's propagation would pick.
    """
    if active_mesh() is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def constrain_cache(buf: jax.Array) -> jax.Array:
    """A [batch, max_len, kv_heads, head_dim] cache buffer: batch over dp, KV heads over tp."""
    return constrain(buf, (BATCH, None, KV_HEADS, None))


def embed_lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """table[tokens] for a [vocab, embed] table; vocab-parallel when the table is split over tp.

    Each tp shard gathers the rows it owns (zeros elsewhere) and one all-reduce sums them,
    which is exact: exactly one shard contributes each row.
    """
    mesh = active_mesh()
    dp, tp = mesh_sizes(mesh)
    if mesh is None or tp == 1 or table.shape[0] % tp:
        return constrain(jnp.take(table, tokens, axis=0), (BATCH,) + (None,) * tokens.ndim)
    b = DP if dp > 1 and tokens.shape[0] % dp == 0 else None
    rest = (None,) * (tokens.ndim - 1)

    def local(tab: jax.Array, tok: jax.Array) -> jax.Array:
        rows = tab.shape[0]
        idx = tok - jax.lax.axis_index(TP) * rows
        owned = (idx >= 0) & (idx < rows)
        out = jnp.take(tab, jnp.clip(idx, 0, rows - 1), axis=0)
        return jax.lax.psum(jnp.where(owned[..., None], out, jnp.zeros_like(out)), TP)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(TP, None), P(b, *rest)),
                         out_specs=P(b, *rest, None), check_vma=False)(table, tokens)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
              visible: jax.Array | None = None, *, impl: str = "auto") -> jax.Array:
    """`pallas_kernels.tree_attention.tree_attention`, run per (dp, tp) shard when a mesh is active.

    Heads are independent, so each device attends with its own q heads over its own KV heads
    (or, when KV heads are replicated, over the one KV head its q heads use): no communication.
    """
    from pallas_kernels.tree_attention import tree_attention

    mesh = active_mesh()
    dp, tp = mesh_sizes(mesh)
    if mesh is None or dp * tp == 1:
        return tree_attention(q, k, v, prefix_lens, visible, impl=impl)
    batch, _, q_heads, _ = q.shape
    kv_heads = k.shape[2]
    if q_heads % tp:
        raise ShardingError(f"attention: q_heads={q_heads} is not divisible by tp={tp}")
    split_kv = kv_heads_sharded(kv_heads, tp)
    b = DP if dp > 1 and batch % dp == 0 else None
    h = TP if tp > 1 else None
    q_spec = P(b, None, h, None)
    kv_spec = P(b, None, h if split_kv else None, None)
    shards_per_kv_head = 1 if split_kv else tp // kv_heads

    def local(q, k, v, lens, *vis):
        if not split_kv:
            # Replicated KV: this shard's q heads all belong to one KV head.
            j = jax.lax.axis_index(TP) // shards_per_kv_head
            k = jax.lax.dynamic_slice_in_dim(k, j, 1, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, j, 1, axis=2)
        return tree_attention(q, k, v, lens, vis[0] if vis else None, impl=impl)

    args = (q, k, v, prefix_lens) + (() if visible is None else (visible,))
    specs = (q_spec, kv_spec, kv_spec, P(b)) + (() if visible is None else (P(b, None, None),))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


# ----------------------------------------------------------------------------- inspection

def collectives(hlo_text: str) -> dict[str, int]:
    """Counts collective ops (all-reduce, all-gather, ...) in compiled HLO text."""
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    counts = {k: 0 for k in kinds}
    for line in hlo_text.splitlines():
        line = line.strip()
        if "=" not in line:
            continue
        op = line.split("=", 1)[1].strip()
        for kind in kinds:
            # "... = f32[2,3]{1,0} all-reduce(...)" or the async "-start" form (the "-done"
            # half is not counted again).
            if f" {kind}(" in op or f" {kind}-start(" in op:
                counts[kind] += 1
    return counts
