"""The MLP's gated activation after XLA's gate_up product: silu(gate) * up in one Triton launch.

At the rows of a 256-node tree (W 257) the verify runs the fused gate_up product as one cuBLAS
GEMM into [rows, 2, mlp] and then an XLA fusion for silu(gate) * up: 6.5 us a layer at the
Qwen3-8B shape (BENCHMARKS.md, twenty-seventh and thirtieth sessions), about 2.9 TB/s over the
19 MB it reads and writes by our count, where `residual_norm` moves its 16.5 MB in 4.5 us (3.7
TB/s). This kernel is that fusion: each program reads one row's block of gate and of up (the two
halves of the product's row) and writes the block of the activation.

The rounding follows the jnp path (`model.mlp_activation`): gate and up as the product gave them
(in the activation dtype), silu(gate) * up in float32, rounded once.

Opt-in (`SpecSettings.activation` "kernel", `spec_round` / `decode_loop --activation kernel`), not
the default: on the H200 it was no faster. Alone at W 257 it took 6.4-6.6 us (the best of its
block shapes 6.38) against 6.32 for XLA's fusion; DDTree(256) as decoding runs it, in turns,
10.405 against 10.43 ms and 10.359 against 10.358 ms on two machines (BENCHMARKS.md,
thirty-first session). `silu_mul_reference` is the same contract in jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import is_power_of_two

# Columns per program at most: 4096 bf16 values of gate and of up (8 KB each) for 4 warps, 32
# values a thread. A guess, to be timed against the others.
MAX_COLS = 4096
MIN_COLS = 128
NUM_WARPS = 4


def block_cols(mlp: int, max_cols: int = MAX_COLS) -> int:
    """The largest power of two <= max_cols that divides mlp (0 if under MIN_COLS: the kernel
    does not apply)."""
    cols = max_cols
    while cols >= MIN_COLS and mlp % cols:
        cols //= 2
    return cols if cols >= MIN_COLS else 0


def applies(mlp: int) -> bool:
    """Whether the kernel takes rows of this many activations (whole power-of-two blocks)."""
    return block_cols(mlp) > 0


def _kernel(gate_ref, up_ref, out_ref):
    """One program: one row's `cols` activations. Refs: gate_ref, up_ref, out_ref [1, cols]."""
    gate = gate_ref[...].astype(jnp.float32)
    up = up_ref[...].astype(jnp.float32)
    out_ref[...] = (gate * jax.nn.sigmoid(gate) * up).astype(out_ref.dtype)


def silu_mul(both: jax.Array, *, cols: int | None = None, num_warps: int = NUM_WARPS,
             interpret: bool = False) -> jax.Array:
    """silu(gate) * up from the fused product, in one launch.

    Args:
      both: [rows, 2, mlp]: per row the gate's mlp values, then up's (the fused gate_up product,
        in the activation dtype).
      cols, num_warps: columns per program (a power of two dividing mlp; default `block_cols`)
        and warps per program.
    Returns:
      [rows, mlp] in both's dtype.
    """
    if both.ndim != 3 or both.shape[1] != 2:
        raise ValueError(f"silu_mul: both must be [rows, 2, mlp] (gate, then up), got {both.shape}")
    rows, _, mlp = both.shape
    cols = block_cols(mlp) if cols is None else cols
    if not cols or not is_power_of_two(cols) or mlp % cols:
        raise ValueError(f"silu_mul: mlp={mlp} needs a power-of-two block of at least {MIN_COLS} that divides it "
                         f"(cols={cols})")
    flat = both.reshape(rows, 2 * mlp)  # free: gate in columns [0, mlp), up in [mlp, 2 mlp)
    blocks = mlp // cols
    return pl.pallas_call(
        _kernel,
        grid=(rows, blocks),
        in_specs=[pl.BlockSpec((1, cols), lambda i, j: (i, j)),
                  pl.BlockSpec((1, cols), lambda i, j: (i, j + blocks))],
        out_specs=pl.BlockSpec((1, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, mlp), both.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="silu_mul",
    )(flat, flat)


@jax.jit
def silu_mul_reference(both: jax.Array) -> jax.Array:
    """`silu_mul` in jnp: the model's own `gated_activation`, as `mlp_activation` applies it."""
    from dflash_jax.model import gated_activation

    return gated_activation(both, both.dtype)
