"""The Hopper tree-attention kernel's split-K merge, straight into tokens, in one launch (Pallas, Triton).

`tree_attention_hopper.hopper_partials` leaves, per (sequence, kv head), one output per program:
the full 128-row blocks split `main_split` ways over the keys, a last partial block
`tail_split` ways, each normalised by its own softmax sum, with its log2-sum-exp. The jnp path
(`tokens_of(merge(out, lse, sched), width, group)`) merges the splits and moves the rows back
to tokens; on an H200 XLA runs that as three kernels (two small weight fusions and a transpose
fusion), 8.9 us per layer at W 272 plus the gaps between launches. This kernel does all of it:
each program reads its rows of every split once, merges them in float32 as `_merge_splits`
does, and writes the real rows token-major ([batch, width, q_heads, head_dim]).

Grid: (batch, kv_heads, main programs + tail programs). A program's time is its loads, and the
tail's rows have 8x the splits of the main blocks' at the real shape (16 against 2), so rows
per program are sized by the splits: each program reads about `_PARTIAL_ROWS` rows of partials
(rows x splits), as independent loads that all come before any arithmetic (the splits
unrolled in Python, one static code path for each range). At W 272 x group 4, head_dim 128:
32 rows (8 tokens) per main program and 4 rows (1 token) per tail program, 16 KB of bf16
partials each, 32 + 16 programs per kv head, 384 in all. An earlier Triton merge ran one
program per 16 tokens looping over the splits as an online merge: 14 us, its 8 tail programs
per kv head (16 dependent steps each) the long pole.

In the DDTree(256) round at Qwen3-8B's shape it took 11.45 ms against 11.79 with XLA's merge
(H200, BENCHMARKS.md); its sizes (`_PARTIAL_ROWS`, warps) are reasoned, not swept.

`tree_attention_hopper.split_merge_reference` is the same contract in jnp: the merge it replaces.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import is_power_of_two

if TYPE_CHECKING:  # the Hopper module imports this one
    from pallas_kernels.tree_attention_hopper import Schedule

# Rows of partials (rows x splits) each program reads: 64 x head_dim 128 x bf16 is 16 KB, 384
# programs at the real shape, ~3 per SM of an H200, all resident in one wave.
_PARTIAL_ROWS = 64
NUM_WARPS = 4


def applies(group: int, head_dim: int, block: int = 128) -> bool:
    """Whether the kernel takes this shape: Triton blocks need power-of-two extents, and a
    program's rows are whole tokens inside one `block`-row block of the partials."""
    return (is_power_of_two(group) and group <= block and block % group == 0
            and is_power_of_two(head_dim))


def _floor_power_of_two(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, n.bit_length() - 1)


def tokens_per_program(sched: Schedule, group: int, block: int = 128) -> tuple[int, int]:
    """(main, tail) tokens per program: powers of two, rows (tokens x group) ~ `_PARTIAL_ROWS`
    / splits so that every program reads about as much, at least one token and at most a block.

    A group too large for the tail's share (group 8 x 16 splits > 64) raises the budget for
    both ranges alike, so that they stay balanced.
    """
    budget = max(_PARTIAL_ROWS, group * (sched.tail_split if sched.tail else 1))

    def tokens(splits: int) -> int:
        rows = min(block, max(group, _floor_power_of_two(budget // splits)))
        return rows // group

    return tokens(sched.main_split), tokens(sched.tail_split)


def _ranges(sched: Schedule, width: int, group: int, block: int, main_tokens: int,
            tail_tokens: int) -> tuple[int, int]:
    """Programs per (sequence, kv head) for the full blocks and for the tail: enough to cover
    the real rows (width x group) of each, none for padding alone."""
    rows = width * group
    main_rows = min(rows, sched.full_blocks * block)
    tail_rows = max(0, rows - sched.full_blocks * block) if sched.tail else 0
    return pl.cdiv(main_rows, main_tokens * group), pl.cdiv(tail_rows, tail_tokens * group)


def _merge(outs: Sequence[jax.Array], lses: Sequence[jax.Array]) -> jax.Array:
    """`tree_attention_hopper._merge_splits` on the splits as lists, the same ops in the same
    order: outs [tokens, group, head_dim] each, lses [tokens, group] f32 -> f32 [tokens, group,
    head_dim]. A row no split saw (all lse -inf) gets weight 0 everywhere: 0, not NaN."""
    top = functools.reduce(jnp.maximum, lses)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = [jnp.exp2(lse - top) for lse in lses]
    total = functools.reduce(jnp.add, weights)
    inv = 1.0 / jnp.where(total > 0, total, 1.0)
    terms = [(w * inv)[..., None] * o.astype(jnp.float32) for w, o in zip(weights, outs)]
    return functools.reduce(jnp.add, terms)


def _merge_rows(out_ref, lse_ref, o_ref, *, partials: Sequence[jax.Array | int], first: jax.Array,
                tokens: int, token0: jax.Array, width: int) -> None:
    """Merges `tokens` tokens (rows first*group ..) of a block over the programs `partials`
    and stores them as tokens token0 .. token0 + tokens - 1; tokens from `width` on are padding:
    not read (loads masked, their memory traffic skipped) and not written.

    The loads all come before any arithmetic and none depends on another, so that they can all
    be in flight at once: a program waits about one round trip to memory, not one per split
    (the earlier merge's online loop waited one per split).
    """
    rows = pl.ds(first, tokens)
    # As int32 scalars: interpret mode's load cannot index with a Python int here.
    partials = [jnp.asarray(p, jnp.int32) for p in partials]
    real = (token0 + jnp.arange(tokens, dtype=jnp.int32)) < width
    lses = [plgpu.load(lse_ref.at[p, rows, :], mask=real[:, None], other=-jnp.inf) for p in partials]
    outs = [plgpu.load(out_ref.at[p, rows, :, :], mask=real[:, None, None], other=0) for p in partials]
    merged = _merge(outs, lses)
    plgpu.store(o_ref.at[pl.ds(token0, tokens)], merged.astype(o_ref.dtype), mask=real[:, None, None])


def _kernel(out_ref, lse_ref, o_ref, *, sched: Schedule, width: int, main_tokens: int,
            tail_tokens: int, main_count: int, tail_count: int) -> None:
    """One program: one sequence, one kv head, `main_tokens` tokens of a full block or
    `tail_tokens` of the partial one (program ids [0, main_count) and then [main_count, ..)).

    Refs (batch and kv head squeezed; a block's 128 rows seen as [128 // group, group]):
    out_ref [programs, block_tokens, group, head_dim]; lse_ref [programs, block_tokens, group]
    f32; o_ref [width, group, head_dim], this kv head's q heads of every token.
    """
    block_tokens = out_ref.shape[1]
    i = pl.program_id(2)

    def main():
        # Programs c * main_split + s (s < main_split) are the splits of full block c.
        per_block = jnp.int32(block_tokens // main_tokens)
        row_block, part = lax.div(i, per_block), lax.rem(i, per_block)
        partials = [row_block * sched.main_split + s for s in range(sched.main_split)]
        _merge_rows(out_ref, lse_ref, o_ref, partials=partials, first=part * main_tokens,
                    tokens=main_tokens, token0=i * main_tokens, width=width)

    def tail():
        # The tail's splits are the last tail_split programs; its rows follow the full blocks'.
        first = (i - main_count) * tail_tokens
        partials = [sched.main_programs + s for s in range(sched.tail_split)]
        _merge_rows(out_ref, lse_ref, o_ref, partials=partials, first=first, tokens=tail_tokens,
                    token0=sched.full_blocks * block_tokens + first, width=width)

    if not tail_count:
        main()
    elif not main_count:
        tail()
    else:
        pl.when(i < main_count)(main)
        pl.when(i >= main_count)(tail)


def _check(out: jax.Array, lse: jax.Array, sched: Schedule, width: int, group: int) -> None:
    """Raises ValueError, naming the argument, where the shapes do not fit the schedule or the
    kernel's blocks."""
    if out.ndim != 5 or out.shape[2] != sched.programs:
        raise ValueError(f"split_merge: out {out.shape} must be [batch, kv_heads, programs="
                         f"{sched.programs}, block, head_dim]")
    batch, kv_heads, programs, block, head_dim = out.shape
    if lse.shape != out.shape[:4] or lse.dtype != jnp.float32:
        raise ValueError(f"split_merge: lse {lse.shape} {lse.dtype} must be float32 {out.shape[:4]}")
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise ValueError(f"split_merge: out dtype {out.dtype} must be floating")
    if not is_power_of_two(block):
        raise ValueError(f"split_merge: out's block of {block} rows must be a power of two")
    if not applies(group, head_dim, block):
        raise ValueError(f"split_merge: group={group} and head_dim={head_dim} must be powers of two "
                         f"(group dividing the block of {block} rows)")
    if width < 1 or width * group > (sched.full_blocks + sched.tail) * block:
        raise ValueError(f"split_merge: width={width} x group={group} must be 1 .. the schedule's "
                         f"{(sched.full_blocks + sched.tail) * block} rows")


def _check_tokens(main_tokens: int, tail_tokens: int, group: int, block: int) -> None:
    """Raises ValueError unless both are powers of two of at most a block's rows."""
    for name, tokens in (("main_tokens", main_tokens), ("tail_tokens", tail_tokens)):
        if not is_power_of_two(tokens) or tokens * group > block:
            raise ValueError(f"split_merge: {name}={tokens} must be a power of two, and x group={group} "
                             f"at most the block of {block} rows")


@functools.partial(jax.jit, static_argnames=("sched", "width", "group", "main_tokens", "tail_tokens",
                                             "num_warps", "interpret"))
def split_merge(out: jax.Array, lse: jax.Array, sched: Schedule, *, width: int, group: int,
                main_tokens: int | None = None, tail_tokens: int | None = None,
                num_warps: int = NUM_WARPS, interpret: bool = False) -> jax.Array:
    """The split-K partials of `hopper_partials` merged into tokens, in one launch.

    A jit of its own, as `hopper_partials`: a model calls it once per layer, and a nested jit
    lowers once for all of them.

    Args:
      out: [batch, kv_heads, sched.programs, 128, head_dim], each program's output normalised
        by its own softmax sum; row r of a kv head is token r // group, q head r % group.
      lse: [batch, kv_heads, sched.programs, 128] f32 log2-sum-exp, -inf where a split saw nothing.
      sched: the `Schedule` the partials were computed with.
      width, group: tokens, and q heads per kv head; rows from width * group on are padding.
      main_tokens, tail_tokens: tokens per program of the full blocks and of the tail (powers of
        two; default `tokens_per_program`); num_warps: warps of a program.
    Returns:
      [batch, width, kv_heads * group, head_dim] in out's dtype, equal to
      `tokens_of(merge(out, lse, sched), width, group)` (the unrolled merge) to float32 rounding.
    """
    _check(out, lse, sched, width, group)
    batch, kv_heads, programs, block, head_dim = out.shape
    default_main, default_tail = tokens_per_program(sched, group, block)
    main_tokens = default_main if main_tokens is None else main_tokens
    tail_tokens = default_tail if tail_tokens is None else tail_tokens
    _check_tokens(main_tokens, tail_tokens, group, block)
    main_count, tail_count = _ranges(sched, width, group, block, main_tokens, tail_tokens)
    block_tokens = block // group
    # A block's rows as [tokens, group] and the output's heads as [kv_heads, group]: reshapes of
    # contiguous dimensions, free in XLA; each program then loads and stores 3-d tiles directly.
    out6 = out.reshape(batch, kv_heads, programs, block_tokens, group, head_dim)
    lse5 = lse.reshape(batch, kv_heads, programs, block_tokens, group)
    sq = pl.squeezed if hasattr(pl, "squeezed") else None
    in_specs = [
        pl.BlockSpec((sq, sq, programs, block_tokens, group, head_dim), lambda b, h, i: (b, h, 0, 0, 0, 0)),
        pl.BlockSpec((sq, sq, programs, block_tokens, group), lambda b, h, i: (b, h, 0, 0, 0)),
    ]
    # Programs of one (sequence, kv head) write disjoint tokens of the same output block.
    out_specs = pl.BlockSpec((sq, width, sq, group, head_dim), lambda b, h, i: (b, 0, h, 0, 0))
    kernel = functools.partial(_kernel, sched=sched, width=width, main_tokens=main_tokens,
                               tail_tokens=tail_tokens, main_count=main_count, tail_count=tail_count)
    merged = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, main_count + tail_count),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=jax.ShapeDtypeStruct((batch, width, kv_heads, group, head_dim), out.dtype),
        # No loop to pipeline: every load is issued up front.
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="split_merge",
    )(out6, lse5)
    return merged.reshape(batch, width, kv_heads * group, head_dim)
