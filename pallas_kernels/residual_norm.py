"""A projection's split-K sum, the residual add and the next RMS norm in one launch (Pallas, Triton).

At 272 rows XLA runs the target's o and down projections (N = 4096 outputs, 64 output tiles of
cuBLAS's 128 x 136 for 132 SMs) as two half-K products, writing float32 partials, and sums
them in the fusions that follow. Those fusions came apart (BENCHMARKS.md, from the dumped
HLO): after the o projection one adds the residual and norms for the MLP
(5.7 us); after the down projection one adds the residual again, re-reading the o partials
(5.3 us), and another norms for the next layer (2.6 us): three kernels, about 40 MB moved.
The model now asks for the partials itself (`model.split_k_product`) and this kernel does each
junction in one pass, reading the partials and the residual once and writing the new residual
and its norm: two kernels and about 31 MB a layer.

The rounding follows the jnp path (`model.output_projection` / `model.mlp`, then
`model.rms_norm`): the product summed in float32 and rounded to the activation dtype, the sum
with the residual rounded again, the norm in float32 and rounded.

`residual_norm_reference` is the same contract in jnp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import next_power_of_two
from pallas_kernels.reference_ops import rms_norm

# Rows per program. One row of 4096 float32 partials is 16 KB per split; a row each keeps a
# program's registers light (8 warps x 32 threads hold 16 values of each operand) and gives 272
# programs at W 272. 2 or 4 rows were no faster (BENCHMARKS.md).
ROWS = 1
# Columns per warp: 8 warps at 4096 took 4.2 us against 4.5 for 4 (BENCHMARKS.md).
_COLUMNS_PER_WARP = 512
MAX_EMBED = 16384
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _kernel(x_ref, parts_ref, w_ref, x_out_ref, h_ref, *, splits: int, embed: int, eps: float):
    """One program: `rows` rows.

    Refs: x_ref [rows, E]; parts_ref [splits, rows, E] f32; w_ref [1, E]; x_out_ref, h_ref
    [rows, E], where E is the embedding padded to a power of two (masked past `embed`).
    """
    cols = jnp.arange(x_ref.shape[-1], dtype=jnp.int32)
    ok = (cols < embed)[None, :]
    dtype = x_ref.dtype

    def part(s: int) -> jax.Array:
        return plgpu.load(parts_ref.at[pl.ds(s, 1)], mask=ok[None], other=0.0)[0]

    product = part(0)
    for s in range(1, splits):  # static: each split's load independent of the others
        product = product + part(s)
    x = plgpu.load(x_ref, mask=ok, other=0).astype(jnp.float32)
    x_new = (x + product.astype(dtype).astype(jnp.float32)).astype(dtype)
    xf = x_new.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) / embed + eps)
    w = plgpu.load(w_ref, mask=ok, other=0).astype(jnp.float32)
    plgpu.store(x_out_ref, x_new, mask=ok)
    plgpu.store(h_ref, (w * (xf * inv)).astype(dtype), mask=ok)


def applies(embed: int) -> bool:
    """Whether the kernel takes rows of `embed` values (padded to a power of two, one block)."""
    return 0 < embed <= MAX_EMBED


def num_warps_for(embed: int) -> int:
    return max(4, next_power_of_two(embed) // _COLUMNS_PER_WARP)


def check(x: jax.Array, parts: jax.Array, weight: jax.Array) -> None:
    """Raises ValueError naming the argument whose shape or dtype does not fit."""
    if x.ndim != 2:
        raise ValueError(f"residual_norm: x must be [rows, embed], got {x.shape}")
    if parts.ndim != 3 or parts.shape[1] < x.shape[0] or parts.shape[2] != x.shape[1]:
        raise ValueError(f"residual_norm: parts must be [splits, rows >= {x.shape[0]}, embed = {x.shape[1]}], "
                         f"got {parts.shape}")
    if parts.dtype != jnp.float32:
        raise ValueError(f"residual_norm: parts must be float32 partial sums, got {parts.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"residual_norm: weight must be [{x.shape[1]}], got {weight.shape}")
    if not applies(x.shape[1]):
        raise ValueError(f"residual_norm: embed {x.shape[1]} is over the kernel's {MAX_EMBED}")
    if jnp.dtype(x.dtype) not in _DTYPES:
        raise ValueError(f"residual_norm: x dtype {x.dtype} is not one of float32, bfloat16, float16")


def residual_norm(x: jax.Array, parts: jax.Array, weight: jax.Array, *, eps: float, rows: int = ROWS,
                  num_warps: int | None = None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x + sum(parts) and its RMS norm, in one launch.

    Args:
      x: [rows, embed] the residual stream (bf16/f16/f32).
      parts: [splits, rows' >= rows, embed] float32 partial sums of the projection added to it
        (the rows past x's are not read: a product over padded rows comes as it is).
      weight: [embed] the RMS norm's weight.
      rows, num_warps: rows per program (a power of two) and warps per program (default
        `num_warps_for(embed)`).
    Returns:
      (x_new [rows, embed] = x + round(sum(parts)), h [rows, embed] = rms_norm(x_new) * weight),
      both in x's dtype.
    """
    check(x, parts, weight)
    n, embed = x.shape
    splits = parts.shape[0]
    num_warps = num_warps_for(embed) if num_warps is None else num_warps
    if rows < 1 or rows & (rows - 1):
        raise ValueError(f"residual_norm: rows={rows} must be a power of two")
    block = next_power_of_two(embed)
    rows = min(rows, next_power_of_two(n))
    padded = pl.cdiv(n, rows) * rows
    if padded != n:  # whole blocks of rows; the pad rows are computed and dropped
        x = jnp.pad(x, ((0, padded - n), (0, 0)))
    if parts.shape[1] < padded:
        parts = jnp.pad(parts, ((0, 0), (0, padded - parts.shape[1]), (0, 0)))
    if block != embed:
        x = jnp.pad(x, ((0, 0), (0, block - embed)))
        parts = jnp.pad(parts, ((0, 0), (0, 0), (0, block - embed)))
        weight = jnp.pad(weight, (0, block - embed))
    row_spec = pl.BlockSpec((rows, block), lambda i: (i, 0))
    x_new, h = pl.pallas_call(
        functools.partial(_kernel, splits=splits, embed=embed, eps=float(eps)),
        grid=(padded // rows,),
        in_specs=[row_spec, pl.BlockSpec((splits, rows, block), lambda i: (0, i, 0)),
                  pl.BlockSpec((1, block), lambda i: (0, 0))],
        out_specs=(row_spec, row_spec),
        out_shape=(jax.ShapeDtypeStruct((padded, block), x.dtype),) * 2,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="residual_norm",
    )(x, parts, weight.reshape(1, block))
    if (padded, block) != (n, embed):
        x_new, h = x_new[:n, :embed], h[:n, :embed]
    return x_new, h


def residual_norm_reference(x: jax.Array, parts: jax.Array, weight: jax.Array, *, eps: float
                            ) -> tuple[jax.Array, jax.Array]:
    """`residual_norm` in jnp, with the model's norm (`reference_ops.rms_norm`)."""
    check(x, parts, weight)
    x_new = x + jnp.sum(parts[:, :x.shape[0]], axis=0).astype(x.dtype)
    return x_new, rms_norm(x_new, weight, eps)
