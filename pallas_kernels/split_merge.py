"""The Hopper kernel's split-K merge, written straight into token layout (Pallas, Triton backend).

The Hopper tree-attention kernel leaves, per kv head, one normalised output and one log-sum-exp
per program (`tree_attention_hopper.hopper_partials`). In jnp (`tree_attention_hopper.merge`
then `tokens_of`) XLA made four kernels of that per layer (BENCHMARKS.md, thirteenth session).
This kernel reads each block of rows' splits once and writes [batch, width, q_heads, head_dim].

Grid: (batch, kv heads, blocks of `tokens` tokens). A block's rows (tokens x group) lie in one
of the kernel's 128-row blocks, so its splits are `main_split` consecutive programs, or the
tail's `tail_split`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention_hopper import ROWS_PER_BLOCK, Schedule

# Finite, so that merging only splits that saw nothing (-inf) never computes (-inf) - (-inf).
_M_INIT = -1e30


def _kernel(out_ref, lse_ref, o_ref, *, sched: Schedule, width: int, group: int, tokens: int):
    """One program: one sequence, one kv head, `tokens` tokens (all of the group's heads).

    Refs (batch and kv head squeezed): out_ref [programs, 128 // group, group, head_dim];
    lse_ref [programs, 128 // group, group] f32 (log2 units); o_ref [width, q_heads, head_dim].
    """
    head = pl.program_id(1)
    t0 = pl.program_id(2) * tokens
    block = (t0 * group) // ROWS_PER_BLOCK
    offset = t0 - block * (ROWS_PER_BLOCK // group)  # first token within the block
    splits = jnp.int32(sched.main_split)
    first = block * sched.main_split
    if sched.tail:
        in_tail = block >= sched.full_blocks
        splits = jnp.where(in_tail, jnp.int32(sched.tail_split), splits)
        first = jnp.where(in_tail, jnp.int32(sched.main_programs), first)
    most = max(sched.main_split, sched.tail_split if sched.tail else 1)
    rows = pl.ds(offset, tokens)
    head_dim = out_ref.shape[-1]

    m = jnp.full((tokens, group), _M_INIT, jnp.float32)
    total = jnp.zeros((tokens, group), jnp.float32)
    acc = jnp.zeros((tokens, group, head_dim), jnp.float32)
    for s in range(most):  # static: the splits' loads are independent of one another
        ok = jnp.broadcast_to(jnp.int32(s) < splits, (tokens, group))
        program = jnp.minimum(first + s, sched.programs - 1)
        lse = plgpu.load(lse_ref.at[program, rows, :], mask=ok, other=-jnp.inf)
        part = plgpu.load(out_ref.at[program, rows, :, :], mask=ok[..., None], other=0).astype(jnp.float32)
        m_new = jnp.maximum(m, lse)
        keep, weight = jnp.exp2(m - m_new), jnp.exp2(lse - m_new)
        acc = acc * keep[..., None] + part * weight[..., None]
        total = total * keep + weight
        m = m_new
    merged = jnp.where(total[..., None] > 0, acc / jnp.where(total > 0, total, 1.0)[..., None], 0.0)
    real = (t0 + jnp.arange(tokens, dtype=jnp.int32)) < width
    plgpu.store(o_ref.at[pl.ds(t0, tokens), pl.ds(head * group, group), :], merged.astype(o_ref.dtype),
                mask=real[:, None, None])


@functools.partial(jax.jit, static_argnames=("sched", "width", "group", "interpret"))  # lowered once per program
def merge_tokens(out: jax.Array, lse: jax.Array, sched: Schedule, *, width: int, group: int,
                 interpret: bool = False) -> jax.Array:
    """`tokens_of(merge(out, lse, sched), width, group)` in one launch.

    out: [batch, kv_heads, programs, 128, head_dim] normalised per program; lse: [batch,
    kv_heads, programs, 128] f32 in log2 units (-inf where a program saw nothing).
    Returns [batch, width, kv_heads * group, head_dim] in out's dtype.
    """
    batch, kv_heads, programs, block, head_dim = out.shape
    if programs != sched.programs or block != ROWS_PER_BLOCK or lse.shape != out.shape[:-1]:
        raise ValueError(f"merge_tokens: out {out.shape} / lse {lse.shape} do not fit the schedule's "
                         f"{sched.programs} programs of {ROWS_PER_BLOCK} rows")
    if ROWS_PER_BLOCK % group or group & (group - 1) or sched.padded_rows < width * group:
        raise ValueError(f"merge_tokens: group={group} must be a power of two dividing {ROWS_PER_BLOCK}, "
                         f"and {sched.padded_rows} rows hold width * group = {width * group}")
    tokens = min(16, ROWS_PER_BLOCK // group)
    per_block = ROWS_PER_BLOCK // group
    sq = pl.squeezed if hasattr(pl, "squeezed") else None
    q_heads = kv_heads * group
    kernel = functools.partial(_kernel, sched=sched, width=width, group=group, tokens=tokens)
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, pl.cdiv(width, tokens)),
        in_specs=[
            pl.BlockSpec((sq, sq, programs, per_block, group, head_dim), lambda b, h, i: (b, h, 0, 0, 0, 0)),
            pl.BlockSpec((sq, sq, programs, per_block, group), lambda b, h, i: (b, h, 0, 0, 0)),
        ],
        # Programs of one sequence write disjoint pieces of the same output block.
        out_specs=pl.BlockSpec((sq, width, q_heads, head_dim), lambda b, h, i: (b, 0, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, width, q_heads, head_dim), out.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="split_merge",
    )(out.reshape(batch, kv_heads, programs, per_block, group, head_dim),
      lse.reshape(batch, kv_heads, programs, per_block, group))
