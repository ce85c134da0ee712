"""The compaction of an accepted tree path's K/V, every layer's buffers in one launch (Pallas, Triton).

After a speculative round's verify pass the target cache holds the K/V of all W tree slots at
L .. L+W-1. The commit moves the accepted path (the root, then the accepted nodes, at increasing
tree slots) to the contiguous slots L .. L+bs-1. In jnp (`compact_reference`) that is one fused
gather + dynamic_update_slice per buffer: 2 x layers XLA kernels per round, 72 for Qwen3-8B, each
about 1.2 us of work plus about 0.8 us of launch gap on an H200 (about 0.15 ms of a 12 ms DDTree
round). `kv_compact` moves the rows of every buffer in ONE launch: a grid over (buffer, sequence,
column block), each program picking its buffer with static `pl.when(program_id(0) == i)`
branches (Pallas refs are separate arguments), every buffer updated in place through
`input_output_aliases`. On an H200 the commit stage of a DDTree(256) round at context 4096 went
from 0.21 to 0.13 ms (BENCHMARKS.md).

Sources and destinations overlap (path[j] >= j, so a slot can be the source of one row and the
destination of an earlier one): each program loads all its source rows as one [rows, columns]
block (bs padded to a power of two), waits at a barrier of its threads, then stores. Programs
touch disjoint (buffer, sequence, columns) regions, so any slots give the reference's result.

Shapes: buffers [batch, max_len, kv_heads, head_dim] (trailing dims are flattened into
C = kv_heads * head_dim columns; C need not be a power of two); slots [batch, bs] int absolute
source slots; starts [batch] int, with starts + bs <= max_len (out-of-range values are clamped
into the buffer, never read or written outside it).
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import is_power_of_two, next_power_of_two
from pallas_kernels.reference_ops import gather_rows, write_rows

NUM_WARPS = 4
# Elements of one program's [rows, columns] block: 16 rows x 256 columns (8 KiB of bf16) by default.
_BLOCK_ELEMENTS = 4096
_MIN_COLUMNS = 16
# Rows (bs padded to a power of two) one program holds at once; deeper blocks are left to jnp.
MAX_ROWS = 256
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _columns(shape: Sequence[int]) -> int:
    return math.prod(shape[2:])


def column_block(bs: int, columns: int) -> int:
    """Columns per program: 4096 elements over the padded rows, at least 16, at most C padded."""
    return min(next_power_of_two(columns), max(_MIN_COLUMNS, _BLOCK_ELEMENTS // next_power_of_two(bs)))


def applies(buffers: Sequence[jax.Array | jax.ShapeDtypeStruct], bs: int) -> bool:
    """Whether `kv_compact` takes these buffers and a path of `bs` rows: at least one buffer, all of
    one shape [batch, max_len, ...] and one float dtype (f32, bf16, f16), and 1 <= bs <= min(max_len,
    MAX_ROWS). (Where it runs is the caller's business: a GPU, no mesh.)"""
    if not buffers:
        return False
    shape, dtype = tuple(buffers[0].shape), jnp.dtype(buffers[0].dtype)
    if len(shape) < 3 or dtype not in _DTYPES:
        return False
    if any(tuple(x.shape) != shape or jnp.dtype(x.dtype) != dtype for x in buffers):
        return False
    return 1 <= bs <= min(shape[1], MAX_ROWS) and _columns(shape) >= 1


def _check(buffers: tuple[jax.Array, ...], slots: jax.Array, starts: jax.Array) -> None:
    if not buffers:
        raise ValueError("kv_compact: buffers is empty")
    shape, dtype = tuple(buffers[0].shape), jnp.dtype(buffers[0].dtype)
    if len(shape) < 3:
        raise ValueError(f"kv_compact: buffers must be [batch, max_len, kv_heads, head_dim], got {shape}")
    for n, x in enumerate(buffers):
        if tuple(x.shape) != shape or jnp.dtype(x.dtype) != dtype:
            raise ValueError(f"kv_compact: buffers must share one shape and dtype: buffers[{n}] is "
                             f"{tuple(x.shape)} {jnp.dtype(x.dtype)}, buffers[0] {shape} {dtype}")
    if dtype not in _DTYPES:
        raise ValueError(f"kv_compact: buffers dtype {dtype} is not one of {[str(d) for d in _DTYPES]}")
    batch, max_len = shape[:2]
    if slots.ndim != 2 or slots.shape[0] != batch or not jnp.issubdtype(slots.dtype, jnp.integer):
        raise ValueError(f"kv_compact: slots must be integer [batch={batch}, bs], got {slots.shape} {slots.dtype}")
    bs = slots.shape[1]
    if not 1 <= bs <= min(max_len, MAX_ROWS):
        raise ValueError(f"kv_compact: slots has bs={bs} rows; 1 <= bs <= min(max_len={max_len}, {MAX_ROWS})")
    if starts.shape != (batch,) or not jnp.issubdtype(starts.dtype, jnp.integer):
        raise ValueError(f"kv_compact: starts must be integer [batch={batch}], got {starts.shape} {starts.dtype}")


def _kernel(slots_ref, starts_ref, *refs, count: int, bs: int, rows: int, max_len: int, columns: int,
            block: int, barrier: bool):
    """One program: buffer program_id(0), sequence program_id(1), columns program_id(2) * block + [0, block).

    Refs (whole arrays): slots_ref [batch, bs] int32; starts_ref [batch] int32; refs: `count`
    inputs [batch, max_len, columns], not read, then the `count` outputs aliased to them.

    Nothing is masked: padding rows (bs up to `rows`, a power of two) repeat row bs-1 (same
    source, same destination) and columns past C repeat column C-1, so they store the very value
    a real row or column stores there. (Masked-off lanes of a store would write back stale values
    in interpret mode.) Indices are clamped into the buffer, so no access leaves it: sources into
    [0, max_len) (the jnp gather clamps too large ones alike), starts into [0, max_len - bs] (as
    dynamic_update_slice does).
    """
    outs = refs[count:]
    which, b, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    j = jnp.minimum(jnp.arange(rows, dtype=jnp.int32), bs - 1)
    src = jnp.clip(plgpu.load(slots_ref.at[b, j]), 0, max_len - 1)[:, None]
    start = jnp.clip(starts_ref[b], 0, max_len - bs)
    dst = (start + j)[:, None]
    col = c * block + jnp.arange(block, dtype=jnp.int32)
    if columns % block:
        col = jnp.minimum(col, columns - 1)
    col = col[None, :]

    for n, ref in enumerate(outs):
        @pl.when(which == n)
        def _move(ref=ref):
            x = plgpu.load(ref.at[b, src, col])  # [rows, block]
            if barrier:  # every source row of this program is read before any row is written
                plgpu.debug_barrier()
            plgpu.store(ref.at[b, dst, col], x)


def kv_compact(buffers: Sequence[jax.Array], slots: jax.Array, starts: jax.Array, *,
               block: int | None = None, num_warps: int = NUM_WARPS, interpret: bool = False
               ) -> tuple[jax.Array, ...]:
    """buffer[b, starts[b] + j] = buffer[b, slots[b, j]] for j < bs, for every buffer, in one launch.

    Args:
      buffers: a tuple of [batch, max_len, kv_heads, head_dim] arrays of one shape and dtype (all
        layers' K, then V); each is updated in place (donate them, or loop-carry them).
      slots: [batch, bs] int, the source slots (in the commit: start + the accepted path's tree
        slots, increasing, slots[:, j] >= starts + j); sources may overlap the destinations.
      starts: [batch] int; callers guarantee starts + bs <= max_len.
      block: columns per program (a power of two; default `column_block(bs, C)`).
      num_warps: warps per program.
    Returns:
      the updated buffers, as a tuple in the order given.
    """
    buffers = tuple(buffers)
    _check(buffers, slots, starts)
    shape, dtype = tuple(buffers[0].shape), buffers[0].dtype
    batch, max_len = shape[:2]
    columns = _columns(shape)
    bs = slots.shape[1]
    rows = next_power_of_two(bs)
    block = column_block(bs, columns) if block is None else block
    if not is_power_of_two(block):
        raise ValueError(f"kv_compact: block={block} must be a power of two")
    starts = starts.astype(jnp.int32)
    slots = slots.astype(jnp.int32)
    flat = tuple(x.reshape(batch, max_len, columns) for x in buffers)
    count = len(flat)
    kernel = functools.partial(_kernel, count=count, bs=bs, rows=rows, max_len=max_len, columns=columns,
                               block=block, barrier=not interpret)
    out = pl.pallas_call(
        kernel,
        grid=(count, batch, pl.cdiv(columns, block)),
        out_shape=tuple(jax.ShapeDtypeStruct(x.shape, dtype) for x in flat),
        input_output_aliases={2 + n: n for n in range(count)},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kv_compact",
    )(slots, starts, *flat)
    return tuple(x.reshape(shape) for x in out)


def compact_reference(buffers: Sequence[jax.Array], slots: jax.Array, starts: jax.Array
                      ) -> tuple[jax.Array, ...]:
    """`kv_compact` in jnp: a gather of the source rows and a row write, per buffer (the commit's
    former path). buffers [batch, max_len, ...]; slots [batch, bs]; starts [batch]."""
    return tuple(write_rows(x, gather_rows(x, slots), starts) for x in buffers)
