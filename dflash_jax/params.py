"""Declaring, initialising and placing parameters.

Each weight is declared once as a `Spec` (shape, logical axes, initialiser) inside the
same dataclass that later holds the array. Sharding is then a table from logical axis
names to mesh axes (`ShardingRules`), never a change to model code.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

# Logical axis names used by every model in the library.
VOCAB, EMBED, Q_HEADS, KV_HEADS, HEAD_DIM, MLP = "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp"


@dataclasses.dataclass(frozen=True)
class Spec:
    """Declaration of one weight: its shape, its logical axes and how to draw it."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # normal | ones | zeros
    fan_in: int | None = None  # normal init uses std = fan_in ** -0.5

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"Spec shape {self.shape} and axes {self.axes} differ in rank")


def is_spec(x: Any) -> bool:
    return isinstance(x, Spec)


def spec_leaves_with_paths(specs: Any) -> list[tuple[str, Spec]]:
    """[(dotted.path, Spec)] in tree order; the path names tensors in errors."""
    flat, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return [(path_str(p), s) for p, s in flat]


def path_str(path: tuple) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return ".".join(parts)


def init_from_specs(specs: Any, key: jax.Array, dtype: Any = jnp.float32, scale: float = 1.0,
                    shardings: Any = None) -> Any:
    """Draws random parameters for a spec tree (tests and benchmarks; real weights come from `convert`).

    shardings: optional tree of Shardings matching `specs`; each weight is then drawn straight
    into its shards (the values do not depend on the sharding).
    """
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    out_shardings = [None] * len(leaves) if shardings is None else jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(dtype)
    drawn = []
    for spec, k, sharding in zip(leaves, keys, out_shardings):
        std = scale * (spec.fan_in or spec.shape[0]) ** -0.5
        drawn.append(_drawer(tuple(spec.shape), dtype, spec.init, float(std), sharding)(k))
    return jax.tree_util.tree_unflatten(treedef, drawn)


@functools.lru_cache(maxsize=None)
def _drawer(shape: tuple[int, ...], dtype: Any, init: str, std: float, sharding: Any) -> Any:
    """One small compiled program per distinct (shape, init, std, sharding), reused by every layer.

    Why not one program for the whole tree: on GPU, compiling hundreds of random draws in one
    program took minutes (an 8B model's 399 tensors, a 135M model's too); a model has only a
    handful of distinct tensor shapes.
    """
    def draw(k: jax.Array) -> jax.Array:
        if init == "ones":
            return jnp.ones(shape, dtype)
        if init == "zeros":
            return jnp.zeros(shape, dtype)
        return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return jax.jit(draw, out_shardings=sharding)


def check_against_specs(params: Any, specs: Any, source: str = "params") -> None:
    """Raises naming the first tensor whose shape disagrees with its declaration."""
    p_flat = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, spec in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]:
        arr = p_flat.get(path)
        if arr is None:
            raise ValueError(f"{source}: tensor {path_str(path)} is missing")
        if tuple(arr.shape) != spec.shape:
            raise ValueError(f"{source}: tensor {path_str(path)} has shape {tuple(arr.shape)}, "
                             f"expected {spec.shape}")


# ----------------------------------------------------------------------------- sharding

@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis name (or None = replicated)."""

    rules: tuple[tuple[str, str | None], ...] = ()

    def mesh_axes(self, axes: tuple[str | None, ...]) -> jax.sharding.PartitionSpec:
        table = dict(self.rules)
        used: set[str] = set()
        out = []
        for a in axes:
            m = table.get(a) if a is not None else None
            # A mesh axis may shard only one dimension of a tensor.
            if m is not None and m in used:
                m = None
            if m is not None:
                used.add(m)
            out.append(m)
        return jax.sharding.PartitionSpec(*out)


REPLICATED = ShardingRules()
TENSOR_PARALLEL = ShardingRules(((VOCAB, "tp"), (Q_HEADS, "tp"), (KV_HEADS, "tp"), (MLP, "tp")))


def shardings_for(specs: Any, mesh: jax.sharding.Mesh, rules: ShardingRules) -> Any:
    """A tree of NamedShardings matching `specs`: the plain table lookup.

    It does not check divisibility; `dflash_jax.sharding.specs_shardings` (and `param_shardings`,
    `placement`) add the tensor-parallel rules for heads, KV heads and vocabulary.
    """
    return jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, rules.mesh_axes(s.axes)),
                        specs, is_leaf=is_spec)


def param_bytes(params: Any) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def cast_floating(params: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


def tree_from_mapping(specs: Any, values: Mapping[str, Any], source: str,
                      convert: Callable[[str, Spec, Any], Any] | None = None) -> Any:
    """Builds a param tree from {dotted.path: array}, checking every declared tensor is present."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    out = []
    for path, spec in leaves:
        name = path_str(path)
        if name not in values:
            raise ValueError(f"{source}: tensor for {name} is missing")
        v = values[name]
        if tuple(v.shape) != spec.shape:
            raise ValueError(f"{source}: tensor {name} has shape {tuple(v.shape)}, expected {spec.shape}")
        out.append(convert(name, spec, v) if convert else v)
    return jax.tree_util.tree_unflatten(treedef, out)
