"""Declaring, initialising and placing parameters.

Each weight is declared once as a `Spec` (shape, logical axes, initialiser) inside the
same dataclass that later holds the array. Sharding is then a table from logical axis
names to mesh axes (`ShardingRules`), never a change to model code.

A `ParamLayout` pairs two declarations of the same weights: `sources`, the tensors as
checkpoints store them (one per checkpoint tensor: q, k, v, gate, up...), and `specs`, the
layout decoding reads (e.g. q, k and v as one `qkv`). Each decoding tensor lists the `Part`s
it is made of: which source tensor goes into which slice of it. Loading, random init and
export are then passes over those declarations: `Builder` writes each source tensor straight
into its slices and places a decoding tensor on its sharding once its parts are in;
`init_layout` draws the sources into their slices on device; `extract` reads them back out.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Logical axis names used by every model in the library.
VOCAB, EMBED, Q_HEADS, KV_HEADS, HEAD_DIM, MLP = "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp"
# The Qwen3.5 / 3.6 hybrid's own axes (dflash_jax.qwen3_5): Gated DeltaNet key heads, value heads
# and conv channels (key-head-major, so a tp split of them follows the key heads).
GDN_K_HEADS, GDN_V_HEADS, GDN_CONV = "gdn_k_heads", "gdn_v_heads", "gdn_conv"


# One axis of a `Part`'s slot: None (the whole axis), an int (one index; the axis goes), or
# (start, stop). Tuples rather than slices: slices are hashable only from Python 3.12.
SlotIndex = tuple[None | int | tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Part:
    """One source tensor's slot in a decoding tensor: `decoding[index] = source.reshape(slot)`."""

    source: str  # dotted path of the tensor in `ParamLayout.sources`
    index: SlotIndex = ()  # () = the whole tensor

    def slices(self) -> tuple:
        return tuple(slice(None) if i is None else slice(*i) if isinstance(i, tuple) else i for i in self.index)

    def slot_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this slot in a tensor of `shape` (an int index drops its axis)."""
        index = self.index + (None,) * (len(shape) - len(self.index))
        out = []
        for i, n in zip(index, shape):
            if i is None:
                out.append(n)
            elif isinstance(i, tuple):
                out.append(len(range(*i)[:n]) if i[1] <= n else -1)
        return tuple(out)


def slot(rank: int, at: Mapping[int, int | tuple[int, int]]) -> SlotIndex:
    """A `Part` index of a rank-`rank` tensor: index `at[axis]` on the axes named, all of the others."""
    return tuple(at.get(axis) for axis in range(rank))


@dataclasses.dataclass(frozen=True)
class Spec:
    """Declaration of one weight: its shape, its logical axes and how to draw it.

    parts: in a decoding layout, the source tensors this one is made of (see `ParamLayout`);
    () means the source tensor of the same path, whole.
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # normal | ones | zeros
    fan_in: int | None = None  # normal init uses std = fan_in ** -0.5
    parts: tuple[Part, ...] = ()

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
    """Draws random parameters for a spec tree as it stands (each tensor its own source).

    shardings: optional tree of Shardings matching `specs`; each weight is then drawn straight
    into its shards (the values do not depend on the sharding).
    """
    return init_layout(ParamLayout(specs, specs), key, dtype, shardings, scale)


@dataclasses.dataclass(frozen=True, eq=False)
class ParamLayout:
    """A decoding layout (`specs`) declared over the tensors checkpoints store (`sources`).

    specs: tree of Spec, the arrays the model functions read; each lists its `parts`.
    sources: tree of Spec, one per checkpoint tensor (already in our axis order, e.g. q as
        [embed, q_heads, head_dim]); their `init` and `fan_in` say how random ones are drawn.
    A source may fill several decoding tensors (the drafter's k and v sit in its block `qkv`
    and in the stacked `context_kv`): every copy then holds the same values.
    """

    specs: Any
    sources: Any

    @functools.cached_property
    def source_specs(self) -> dict[str, Spec]:
        """{dotted path: Spec} of the sources, in tree order."""
        return dict(spec_leaves_with_paths(self.sources))

    @functools.cached_property
    def plan(self) -> list[tuple[str, Spec, tuple[Part, ...]]]:
        """(decoding path, Spec, its parts) in tree order, each part checked against its source."""
        sources = self.source_specs
        out, used = [], set()
        for path, spec in spec_leaves_with_paths(self.specs):
            parts = spec.parts or (Part(path),)
            for part in parts:
                src = sources.get(part.source)
                if src is None:
                    raise ValueError(f"layout: {path} names the source {part.source}, which is not declared")
                slot = part.slot_shape(spec.shape)
                if -1 in slot or int(np.prod(slot)) != int(np.prod(src.shape)):
                    raise ValueError(f"layout: {part.source} {src.shape} does not fit its slot {slot} of {path}")
                used.add(part.source)
            out.append((path, spec, parts))
        unused = [p for p in sources if p not in used]
        if unused:
            raise ValueError(f"layout: sources {unused[:3]} go into no decoding tensor")
        return out

    @functools.cached_property
    def uses(self) -> dict[str, list[tuple[str, Part]]]:
        """source path -> [(decoding path, part)] it fills."""
        out: dict[str, list[tuple[str, Part]]] = {p: [] for p in self.source_specs}
        for path, _, parts in self.plan:
            for part in parts:
                out[part.source].append((path, part))
        return out


class Builder:
    """Fills a layout's decoding tensors from its source tensors, given one at a time in any order.

    A decoding tensor goes to its device(s) (`sharding(path, spec)`, None: the default device) as
    soon as its last part is in, so the host holds only the tensors still being filled: one
    layer's at a time when sources arrive layer by layer, plus any tensor that spans layers
    (the drafter's `context_kv`). Each source is copied once on the host (cast to `dtype`); a
    source that is a whole decoding tensor is placed from that copy.
    """

    def __init__(self, layout: ParamLayout, dtype: Any, sharding: Callable[[str, Spec], Any] | None = None):
        self.layout = layout
        self.dtype = np.dtype(dtype)
        self._sharding = sharding or (lambda path, spec: None)
        self._specs = {path: spec for path, spec, _ in layout.plan}
        self._waiting = {path: {p.source for p in parts} for path, _, parts in layout.plan}
        self._buffers: dict[str, np.ndarray] = {}
        self._done: dict[str, jax.Array] = {}
        self._given: set[str] = set()

    def put(self, source: str, x: np.ndarray) -> None:
        """Writes source tensor `source` (host array, its declared shape) into its slots."""
        if source in self._given:
            raise ValueError(f"{source} was given twice")
        self._given.add(source)
        # A copy, so no placed tensor aliases the caller's buffer (a memory-mapped file, say).
        x = np.array(x, dtype=self.dtype)
        for path, part in self.layout.uses[source]:
            spec = self._specs[path]
            if part.index == () and len(self._waiting[path]) == 1:
                self._place(path, x.reshape(spec.shape))
                continue
            buf = self._buffers.get(path)
            if buf is None:
                buf = self._buffers[path] = np.zeros(spec.shape, self.dtype)
            slot = part.slices()
            buf[slot] = x.reshape(buf[slot].shape)
            self._waiting[path].discard(source)
            if not self._waiting[path]:
                self._place(path, self._buffers.pop(path))

    def _place(self, path: str, y: np.ndarray) -> None:
        self._waiting[path] = set()
        sharding = self._sharding(path, self._specs[path])
        self._done[path] = jax.device_put(y, sharding) if sharding is not None else jax.device_put(y)

    def missing(self) -> list[str]:
        """Source paths not given yet, in declaration order."""
        return [p for p in self.layout.source_specs if p not in self._given]

    def finish(self) -> Any:
        """The decoding tree; raises ValueError naming the first missing source."""
        missing = self.missing()
        if missing:
            raise ValueError(f"source tensor {missing[0]} is missing")
        treedef = jax.tree.structure(self.layout.specs, is_leaf=is_spec)
        return jax.tree_util.tree_unflatten(treedef, [self._done[path] for path, _, _ in self.layout.plan])


def assemble(layout: ParamLayout, arrays: Any, dtype: Any = None,
             sharding: Callable[[str, Spec], Any] | None = None) -> Any:
    """The decoding tree of `layout` from source arrays: a tree shaped like `layout.sources` or
    a {dotted path: array} mapping. dtype: None keeps each array's dtype (the first one's)."""
    if not isinstance(arrays, Mapping):
        arrays = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(arrays)[0]}
    first = next(iter(arrays.values()))
    builder = Builder(layout, dtype or first.dtype, sharding)
    for path, spec in layout.source_specs.items():
        if path not in arrays:
            raise ValueError(f"source tensor {path} is missing")
        x = np.asarray(arrays[path])
        if tuple(x.shape) != spec.shape:
            raise ValueError(f"source tensor {path} has shape {tuple(x.shape)}, expected {spec.shape}")
        builder.put(path, x)
    return builder.finish()


def extract(layout: ParamLayout, params: Any) -> dict[str, np.ndarray]:
    """The source tensors (host arrays by dotted path, in declaration order) read back out of
    params in `layout`'s decoding layout; each from its first slot."""
    check_against_specs(params, layout.specs)
    flat = {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    sources = layout.source_specs
    out: dict[str, np.ndarray] = {}
    for path, _, parts in layout.plan:
        todo = [p for p in parts if p.source not in out]
        if todo:
            whole = np.asarray(flat[path])
            for part in todo:
                out[part.source] = np.ascontiguousarray(whole[part.slices()].reshape(sources[part.source].shape))
    return {p: out[p] for p in sources}


def layout_of(params: Any, layouts: Sequence[ParamLayout]) -> ParamLayout | None:
    """The first of `layouts` whose decoding tree has the structure of `params` (which weights
    are present), or None."""
    held = jax.tree.structure(params)
    for layout in layouts:
        if jax.tree.structure(layout.specs, is_leaf=is_spec) == held:
            return layout
    return None


def init_layout(layout: ParamLayout, key: jax.Array, dtype: Any = jnp.float32, shardings: Any = None,
                scale: float = 1.0) -> Any:
    """Random parameters in `layout`'s decoding layout, drawn on device straight into their
    slots (and shards: `shardings`, a tree of Shardings matching `layout.specs`, or None).

    Each source is drawn with its own key (`key` split over the sources in order), so the result
    equals `assemble(layout, init_from_specs(layout.sources, key))`, whatever the layout.
    """
    sources = layout.source_specs
    keys = dict(zip(sources, jax.random.split(key, len(sources))))
    out_shardings = [None] * len(layout.plan) if shardings is None else jax.tree_util.tree_leaves(
        shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    dtype = jnp.dtype(dtype)
    drawn = []
    for (path, spec, parts), sharding in zip(layout.plan, out_shardings):
        statics = []
        for part in parts:
            src = sources[part.source]
            statics.append((src.shape, src.init, float(scale * (src.fan_in or src.shape[0]) ** -0.5), part.index))
        drawn.append(_builder(tuple(spec.shape), dtype, tuple(statics), sharding)(*[keys[p.source] for p in parts]))
    return jax.tree_util.tree_unflatten(jax.tree.structure(layout.specs, is_leaf=is_spec), drawn)


def _draw(k: jax.Array, shape: tuple[int, ...], init: str, std: float, dtype: Any) -> jax.Array:
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)


@functools.lru_cache(maxsize=None)
def _builder(shape: tuple[int, ...], dtype: Any, parts: tuple, sharding: Any) -> Any:
    """One small compiled program per distinct (shape, parts, sharding), reused by every layer.

    Why not one program for the whole tree: on GPU, compiling hundreds of random draws in one
    program took minutes (an 8B model's 399 tensors, a 135M model's too); a model has only a
    handful of distinct tensor shapes.
    """
    def build(*keys: jax.Array) -> jax.Array:
        if len(parts) == 1 and parts[0][3] == ():
            src_shape, init, std, _ = parts[0]
            return _draw(keys[0], src_shape, init, std, dtype).reshape(shape)
        out = jnp.zeros(shape, dtype)
        for k, (src_shape, init, std, index) in zip(keys, parts):
            slot = Part("", index).slices()
            out = out.at[slot].set(_draw(k, src_shape, init, std, dtype).reshape(out[slot].shape))
        return out
    return jax.jit(build, out_shardings=sharding)


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


TENSOR_PARALLEL = ShardingRules(((VOCAB, "tp"), (Q_HEADS, "tp"), (KV_HEADS, "tp"), (MLP, "tp"),
                                 (GDN_K_HEADS, "tp"), (GDN_V_HEADS, "tp"), (GDN_CONV, "tp")))


def param_bytes(params: Any) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def cast_floating(params: Any, dtype: Any) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
