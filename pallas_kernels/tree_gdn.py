"""The tree-aware Gated DeltaNet verify chunk (the WY form under an ancestor mask) as one kernel.

Per sequence and value head, with W nodes in topological order (node 0 the root), the state S0
[dk, dv] before them, G(t) the sum of the gates along root..t and D[t, s] = exp(G(t) - G(s))
where s is an ancestor-or-self of t (else 0):

    A = beta * (K K^T) * D on strict ancestors;  (I + A) U = beta * (V - exp(G) * (K S0));
    O = exp(G) * (Q S0) + ((Q K^T) * D) U.

This file holds, side by side:

* ``tree_gdn_reference``: plain jnp (any float dtype; the XLA path of the model and of prefill).
* ``tree_gdn_pallas``: a Pallas kernel on the Triton GPU backend, one program per (sequence,
  value head, block of value columns), key heads shared by GQA through the BlockSpec index map.
* ``default_block_sizes``: its row block, value columns and warps for a shape.
* ``tree_gdn``: the dispatcher ("auto": the kernel on a GPU without a mesh, the reference
  elsewhere); ``impl_for_attention``: its impl for a decoder's attention impl.

The kernel walks the W rows in blocks of ``block`` (a power of two >= 16, Triton's smallest dot
operand). Block i first gathers what earlier blocks contribute (``A[i, j] U[j]`` and
``(Q K^T * D)[i, j] U[j]``, with tl.dot; skipped where block j holds no ancestor of block i), then solves its own unit lower triangular diagonal block:
the block's inverse by forward substitution (``block`` steps over a [block, block] tile) and one
dot with the right-hand side. Everything runs in float32 with float32 (IEEE, not TF32) dots. The
U of finished blocks goes to the output and is read back from there by later blocks, so a
program holds O(block x dk + dk x block_v) values whatever W is: W = 1 + 512 runs in the same tiles as
W = 16. W is padded to a multiple of ``block`` with nodes that see only themselves and have zero
q, k, v, beta and gate; no real node sees them, so they change nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import is_power_of_two

# "auto" (kernel on a GPU without a mesh, else reference), "pallas" (the kernel), "reference"
# (jnp), "interpret" (the kernel in Pallas' interpreter, for CPU tests).
GdnImpl = Literal["auto", "pallas", "reference", "interpret"]
IMPLS: tuple[str, ...] = get_args(GdnImpl)

# Triton's dot needs at least 16 rows and columns per operand.
_MIN_BLOCK = 16
_HI = lax.Precision.HIGHEST


def _squeezed():
    """The block-shape marker for a squeezed dimension (``pl.squeezed`` on newer jax)."""
    return getattr(pl, "squeezed", None)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array,
                  visible: jax.Array, state0: jax.Array) -> tuple[int, int, int, int, int, int, int]:
    """Returns (batch, key_heads, value_heads, width, dk, dv, group); raises naming the tensor."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"tree_gdn: q and k must both be [batch, Hk, W, dk], got {q.shape} and {k.shape}")
    batch, key_heads, width, dk = q.shape
    if v.ndim != 4 or v.shape[0] != batch or v.shape[2] != width:
        raise ValueError(f"tree_gdn: v must be [batch={batch}, Hv, W={width}, dv], got {v.shape}")
    value_heads, dv = v.shape[1], v.shape[3]
    if value_heads % key_heads:
        raise ValueError(f"tree_gdn: value heads ({value_heads}, v) must be a multiple of key heads "
                         f"({key_heads}, q/k)")
    for name, x in (("beta", beta), ("decay", decay)):
        if x.shape != (batch, value_heads, width):
            raise ValueError(f"tree_gdn: {name} must be [batch, Hv, W] = {(batch, value_heads, width)}, "
                             f"got {x.shape}")
    if visible.ndim != 3 or visible.shape[0] not in (1, batch) or visible.shape[1:] != (width, width):
        raise ValueError(f"tree_gdn: visible must be [batch or 1, W, W] with W={width}, got {visible.shape}")
    if state0.shape != (batch, value_heads, dk, dv):
        raise ValueError(f"tree_gdn: state0 must be [batch, Hv, dk, dv] = {(batch, value_heads, dk, dv)}, "
                         f"got {state0.shape}")
    return batch, key_heads, value_heads, width, dk, dv, value_heads // key_heads


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------

def tree_gdn_reference(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array,
                       visible: jax.Array, state0: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The WY form over W nodes in jnp, computed in state0's dtype at HIGHEST precision.

    Args:
      q, k: [batch, Hk, W, dk], L2-normalised (q also scaled); value head h reads key head
        h // (Hv // Hk).
      v: [batch, Hv, W, dv]; beta: [batch, Hv, W]; decay: [batch, Hv, W], G(t).
      visible: [batch or 1, W, W] bool, ancestor-or-self (every row sees itself; causal for a
        prefill chunk).
      state0: [batch, Hv, dk, dv], the state before the nodes.
    Returns:
      (O, U), both [batch, Hv, W, dv] in state0's dtype.
    """
    batch, key_heads, value_heads, width, dk, dv, group = _check_shapes(q, k, v, beta, decay, visible, state0)
    dtype = state0.dtype
    q, k, v, beta, decay = (x.astype(dtype) for x in (q, k, v, beta, decay))
    # Value heads grouped under their key head: [B, Hk, group, ...]. The Gram products K K^T and
    # Q K^T are made once per key head and K S0, Q S0 as one product over the group's states,
    # instead of repeating q and k to every value head (3x the Gram work at Qwen3.6's 48 / 16).
    v = v.reshape(batch, key_heads, group, width, dv)
    beta, decay = (x.reshape(batch, key_heads, group, width) for x in (beta, decay))
    s0 = state0.reshape(batch, key_heads, group, dk, dv)
    vis = visible.astype(bool)[:, None, None]
    # The difference is masked before the exp: off the mask it can be positive and overflow.
    diff = decay[..., :, None] - decay[..., None, :]
    d = jnp.exp(jnp.where(vis, diff, -jnp.inf))
    strict = vis & ~jnp.eye(width, dtype=bool)
    kk = jnp.einsum("bhtk,bhsk->bhts", k, k, precision=_HI)[:, :, None]
    a = jnp.where(strict, beta[..., None] * kk * d, 0)
    e = jnp.exp(decay)[..., None]
    rhs = beta[..., None] * (v - e * jnp.einsum("bhtk,bhgkv->bhgtv", k, s0, precision=_HI))
    # (I + A) U = rhs; unit_diagonal: the solver never reads a's (zero) diagonal.
    u = jax.scipy.linalg.solve_triangular(a, rhs, lower=True, unit_diagonal=True)
    scores = jnp.einsum("bhtk,bhsk->bhts", q, k, precision=_HI)[:, :, None] * d
    out = e * jnp.einsum("bhtk,bhgkv->bhgtv", q, s0, precision=_HI) + jnp.einsum(
        "bhgts,bhgsv->bhgtv", scores, u, precision=_HI)
    out, u = (x.reshape(batch, value_heads, width, dv) for x in (out, u))
    return out, u


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the kernel.

    block: rows per step (a power of two >= 16); W is padded to a multiple of it.
    block_v: value columns per program (a power of two >= 16 dividing dv). The solve and the
      outputs are independent column by column, so programs of one head may split dv, each
      recomputing the head's Gram matrices and diagonal inverses for its columns.
    """
    block: int
    block_v: int
    num_warps: int
    num_stages: int


# Programs that count as filling an H200's 132 SMs.
_FULL_GRID = 128


def default_block_sizes(batch: int, value_heads: int, width: int, dk: int, dv: int) -> BlockSizes:
    """Block sizes for a shape (chosen from the work per step; not tuned on a GPU yet).

    block: 16 rows for W <= 16 (one step, nothing padded past Triton's minimum), else 32: the
    diagonal solve is `block` sequential steps over a block x block tile and the off-diagonal
    work (W / block)^2 / 2 steps of three small dots; 32 keeps both moderate for W = 17 to 513.
    block_v: dv split until the grid has _FULL_GRID programs (down to 32 columns): batch 1 at
    48 value heads has 48 programs of whole heads, which would leave most of an H200's SMs idle.
    Shared memory per program is a few [block, dk] float32 tiles and the [dk, block_v] state tile
    (64 KB at 128 x 128), within an sm_86 block's 99 KB. 8 warps for a 128-column state tile,
    else 4.
    """
    block = _MIN_BLOCK if width <= _MIN_BLOCK else 32
    block_v = dv
    while batch * value_heads * (dv // block_v) < _FULL_GRID and block_v > 32:
        block_v //= 2
    return BlockSizes(block=block, block_v=block_v, num_warps=8 if block_v >= 128 else 4, num_stages=1)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------

def _dot(x: jax.Array, y: jax.Array, contract_y: int) -> jax.Array:
    """x @ y (contract_y 0) or x @ y^T (contract_y 1) in float32 at IEEE precision."""
    return lax.dot_general(x, y, (((1,), (contract_y,)), ((), ())), precision=_HI,
                           preferred_element_type=jnp.float32)


def _masked_decay(g_rows: jax.Array, g_cols: jax.Array, seen: jax.Array) -> jax.Array:
    """D = exp(G(t) - G(s)) where seen, else 0; masked before the exp (it may be positive off
    the mask and overflow)."""
    return jnp.where(seen, jnp.exp(jnp.where(seen, g_rows[:, None] - g_cols[None, :], 0.0)), 0.0)


def _unit_lower_inverse(a: jax.Array, rows: jax.Array, cols: jax.Array) -> jax.Array:
    """(I + a)^-1 for a strictly lower triangular [n, n] tile, by forward substitution.

    Row r of X = (I + a)^-1 is e_r - sum_{s < r} a[r, s] X[s]: rows above r are final when row r
    is made, and a[r, s] = 0 for s >= r, so the sum may run over every row. Stable for any a
    (unlike the product of (I + a^(2^m)) factors, whose powers grow like binomials when keys
    align and gates are near 1).
    """
    n = a.shape[0]
    eye = jnp.where(rows == cols, 1.0, 0.0).astype(jnp.float32)

    def step(r, x):
        a_r = jnp.sum(jnp.where(rows == r, a, 0.0), axis=0)  # [n], a[r, s] by s
        update = jnp.sum(a_r[:, None] * x, axis=0)  # sum_s a[r, s] X[s, :]
        return x - jnp.where(rows == r, update[None, :], 0.0)

    return lax.fori_loop(1, n, step, eye)


def _tree_gdn_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, vis_ref, s0_ref, o_ref, u_ref, *,
                     block: int, num_blocks: int, interpret: bool):
    f32 = jnp.float32
    rows = lax.broadcasted_iota(jnp.int32, (block, block), 0)
    cols = lax.broadcasted_iota(jnp.int32, (block, block), 1)

    def load_u(sl):
        if interpret:
            return u_ref[sl, :]
        # Written by this program in an earlier step: a volatile load is never served from the
        # read-only (non-coherent) path, which assumes the data does not change during the kernel.
        return plgpu.load(u_ref.at[sl, :], volatile=True)

    def row_block(i, carry):
        sl = pl.ds(pl.multiple_of(i * block, block), block)
        q_i = q_ref[sl, :].astype(f32)
        k_i = k_ref[sl, :].astype(f32)
        beta_i = beta_ref[sl].astype(f32)
        g_i = decay_ref[sl].astype(f32)
        s0 = s0_ref[...].astype(f32)
        e_i = jnp.exp(g_i)[:, None]
        rhs = beta_i[:, None] * (v_ref[sl, :].astype(f32) - e_i * _dot(k_i, s0, 0))
        out = e_i * _dot(q_i, s0, 0)

        def earlier(j, acc):
            sj = pl.ds(pl.multiple_of(j * block, block), block)
            vis = vis_ref[sl, sj].astype(jnp.int32)
            seen = vis != 0

            def gather(acc):
                rhs, out = acc
                k_j = k_ref[sj, :].astype(f32)
                u_j = load_u(sj)
                d = _masked_decay(g_i, decay_ref[sj].astype(f32), seen)
                rhs = rhs - _dot(beta_i[:, None] * _dot(k_i, k_j, 1) * d, u_j, 0)
                out = out + _dot(_dot(q_i, k_j, 1) * d, u_j, 0)
                return rhs, out

            # In a wide tree most blocks of earlier nodes hold no ancestor of this block's nodes
            # (siblings and cousins): skip their loads and dots.
            # (max, not any: Triton lowers no boolean reduction.)
            return lax.cond(jnp.max(vis) > 0, gather, lambda acc: acc, acc)

        rhs, out = lax.fori_loop(0, i, earlier, (rhs, out))
        d = _masked_decay(g_i, g_i, vis_ref[sl, sl] != 0)
        a = jnp.where(rows > cols, beta_i[:, None] * _dot(k_i, k_i, 1) * d, 0.0)
        u_i = _dot(_unit_lower_inverse(a, rows, cols), rhs, 0)
        out = out + _dot(_dot(q_i, k_i, 1) * d, u_i, 0)
        u_ref[sl, :] = u_i.astype(u_ref.dtype)
        o_ref[sl, :] = out.astype(o_ref.dtype)
        if not interpret:
            # Later blocks read this U back: every thread's stores must land first.
            plgpu.debug_barrier()
        return carry

    lax.fori_loop(0, num_blocks, row_block, 0)


def tree_gdn_pallas(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array,
                    visible: jax.Array, state0: jax.Array, *, block: int | None = None,
                    block_v: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The verify chunk as a Pallas Triton kernel; same contract as ``tree_gdn_reference``.

    Grid (batch, Hv, dv / block_v): one program per sequence, value head and block of value
    columns, reading key head h // group by its index map (no repeated copy of q, k). Computes in float32 and returns (O, U) in float32.
    dk and dv must be powers of two >= 16 (Qwen3.5 / 3.6: 128). Tiling left as None comes from
    ``default_block_sizes``.
    """
    batch, key_heads, value_heads, width, dk, dv, group = _check_shapes(
        q, k, v, beta, decay, visible, state0)
    blocks = default_block_sizes(batch, value_heads, width, dk, dv)
    given = (("block", block), ("block_v", block_v), ("num_warps", num_warps), ("num_stages", num_stages))
    blocks = dataclasses.replace(blocks, **{n: x for n, x in given if x is not None})
    for name, size in (("dk", dk), ("dv", dv), ("block", blocks.block), ("block_v", blocks.block_v)):
        if size < _MIN_BLOCK or not is_power_of_two(size):
            raise ValueError(f"tree_gdn_pallas: {name}={size} must be a power of two >= {_MIN_BLOCK} (Triton)")
    if blocks.block_v > dv:
        raise ValueError(f"tree_gdn_pallas: block_v={blocks.block_v} exceeds dv={dv}")
    f32 = jnp.float32
    padded = pl.cdiv(width, blocks.block) * blocks.block
    pad = padded - width
    visible = jnp.broadcast_to(visible.astype(bool), (batch, width, width))
    if pad:
        def pad_nodes(x: jax.Array, axis: int) -> jax.Array:
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, pad)
            return jnp.pad(x, widths)

        q, k, v = (pad_nodes(x, 2) for x in (q, k, v))
        beta, decay = (pad_nodes(x, 2) for x in (beta, decay))
        # A padding node sees itself only (its row of the solve is then u = rhs = 0).
        padding_self = jnp.eye(padded, dtype=bool) & (jnp.arange(padded) >= width)[:, None]
        visible = pad_nodes(pad_nodes(visible, 1), 2) | padding_self
    sq = _squeezed()
    bv = blocks.block_v
    value_spec = pl.BlockSpec((sq, sq, padded, bv), lambda b, h, c: (b, h, 0, c))
    key_spec = pl.BlockSpec((sq, sq, padded, dk), lambda b, h, c: (b, h // group, 0, 0))
    gate_spec = pl.BlockSpec((sq, sq, padded), lambda b, h, c: (b, h, 0))
    kernel = functools.partial(_tree_gdn_kernel, block=blocks.block, num_blocks=padded // blocks.block,
                               interpret=interpret)
    out, u = pl.pallas_call(
        kernel,
        grid=(batch, value_heads, dv // bv),
        in_specs=[key_spec, key_spec, value_spec, gate_spec, gate_spec,
                  pl.BlockSpec((sq, padded, padded), lambda b, h, c: (b, 0, 0)),
                  pl.BlockSpec((sq, sq, dk, bv), lambda b, h, c: (b, h, 0, c))],
        out_specs=[value_spec, value_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, value_heads, padded, dv), f32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="tree_gdn",
    )(q.astype(f32), k.astype(f32), v.astype(f32), beta.astype(f32), decay.astype(f32),
      visible.astype(jnp.int8), state0.astype(f32))
    return out[:, :, :width], u[:, :, :width]


# --------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------

def kernel_takes(dk: int, dv: int) -> bool:
    """Whether the kernel takes these head sizes (powers of two >= 16)."""
    return all(n >= _MIN_BLOCK and is_power_of_two(n) for n in (dk, dv))


def resolve_impl(impl: GdnImpl = "auto", backend: str | None = None) -> str:
    """What ``tree_gdn`` runs for ``impl``: "auto" is "reference" (XLA) on every backend.

    The kernel is not the default: on an H200 at the Qwen3.6-27B GDN shape (48 value heads,
    dk = dv = 128, batch 1) its chunk took 140 / 692 / 6959 us against 49 / 61 / 259 us for XLA at
    W = 16 / 64 / 257, XLA then repeating q, k to every value head (BENCHMARKS.md, "The tree-GDN
    verify"): its row-block walk serialises the solve. It runs only when asked for ("pallas",
    "interpret"). ``backend`` is accepted so that callers need not special-case it.
    """
    if impl not in IMPLS:
        raise ValueError(f"tree_gdn: impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    del backend
    return "reference" if impl == "auto" else impl


def impl_for_attention(attention: str, dk: int, dv: int) -> GdnImpl:
    """The chunk's impl that goes with an attention impl (`pallas_kernels.tree_attention.IMPLS`,
    a decoder's `Impl.attention`) for head sizes dk, dv: "reference" keeps the chunk in jnp as it
    keeps a round's other kernels; "interpret" interprets the kernel where it takes the head sizes
    (a tiny test model's 8 it does not: jnp then); the kernel choices leave it "auto"."""
    if attention == "reference" or (attention == "interpret" and not kernel_takes(dk, dv)):
        return "reference"
    return "interpret" if attention == "interpret" else "auto"


def tree_gdn(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array,
             visible: jax.Array, state0: jax.Array, *, impl: GdnImpl = "auto") -> tuple[jax.Array, jax.Array]:
    """The verify chunk by ``impl`` (see ``resolve_impl``); arguments as ``tree_gdn_reference``.

    "auto" also keeps the reference for head sizes the kernel does not take (a tiny test
    model's). Returns (O, U) [batch, Hv, W, dv] in state0's dtype.
    """
    which = resolve_impl(impl)
    if which == "reference" or (impl == "auto" and not kernel_takes(q.shape[-1], v.shape[-1])):
        return tree_gdn_reference(q, k, v, beta, decay, visible, state0)
    out, u = tree_gdn_pallas(q, k, v, beta, decay, visible, state0, interpret=which == "interpret")
    return out.astype(state0.dtype), u.astype(state0.dtype)
