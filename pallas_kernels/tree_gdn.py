"""The tree-aware Gated DeltaNet verify chunk (the WY form under an ancestor mask) as Pallas kernels.

Per sequence and value head, with W nodes in topological order (node 0 the root), the state S0
[dk, dv] before them, G(t) the sum of the gates along root..t and D[t, s] = exp(G(t) - G(s))
where s is an ancestor-or-self of t (else 0):

    A = beta * (K K^T) * D on strict ancestors;  (I + A) U = beta * (V - exp(G) * (K S0));
    O = exp(G) * (Q S0) + ((Q K^T) * D) U.

This file holds, side by side:

* ``tree_gdn_reference``: plain jnp (any float dtype; the XLA path of the model and of prefill),
  solving (I + A) U = rhs by a blockwise doubling inverse, with TF32x3 dots for float32 on a GPU
  (``default_dots``).
* ``tree_gdn_pallas``: two Pallas kernels on the Triton GPU backend (below), key heads shared
  by GQA through the BlockSpec index maps.
* ``default_block_sizes``: their tiling and dot precision for a shape.
* ``tree_gdn``: the dispatcher (``resolve_impl`` says what "auto" runs); ``impl_for_attention``:
  its impl for a decoder's attention impl.

Design. The rows go in blocks of ``block`` (a power of two >= 16, Triton's smallest dot operand),
nb of them. With T_i = (I + A_ii)^-1, P = (Q K^T) * D and rhs_i = beta_i (V_i - exp(G_i) K_i S0),
block forward substitution reads U_i = T_i rhs_i - sum_{j<i} (T_i A_ij) U_j, and putting that U_i
into O_i's diagonal term P_ii U_i gives

    O_i = o0_i + sum_{j<i} (P_ij - P_ii T_i A_ij) U_j,   o0_i = exp(G_i) Q_i S0 + P_ii T_i rhs_i.

Everything but the products with U_j is independent across blocks: per head at W = 257 (block
32, dk = dv = 128), 24 MFLOP of Gram blocks, 19 of K S0 and Q S0 and 5 of block inverses need no
U, and only 19 MFLOP of [block, block] x [block, dv] products with U wait for earlier blocks. So:

1. The block kernel, grid (batch, Hv, nb), every program independent: block i's Gram blocks
   against itself and every earlier block, T_i, u0_i = T_i rhs_i, o0_i, At_ij = T_i A_ij and
   Pt_ij = P_ij - P_ii At_ij, each written as [nb, nb, block, block] float32 per head (about
   W^2 values, 0.33 MB at W = 257, half of it used; the next kernel reads them back from L2).
   With ``BlockSizes.share_keys`` a program does the GQA group of value heads of one key head,
   making the Gram blocks once for the group (grid (batch, Hk, nb)).
2. The substitution kernel, grid (batch, Hv, dv / block_v): U_i = u0_i - sum_{j<i} At_ij U_j
   and O_i = o0_i + sum_{j<i} Pt_ij U_j, unrolled over the blocks (``_substitution_kernel``),
   whose only dots are [block, block] x [block, block_v].

W <= block needs the block kernel alone: one launch, at W = 16 by default. Two launches rather
than one program per (sequence, value head) walking its rows: that walk put the Gram blocks,
the inverses and K S0 in its serial chain, on 48 programs at batch 1 (a third of an H200's
SMs), and took 140 / 692 / 6959 us against XLA's 49 / 61 / 259 at W = 16 / 64 / 257. The split
costs a launch and the pair matrices' round trip through memory. It is still behind XLA: 48.9 /
97.5 us against 38.9 / 58.6 at W = 16 / 64 on an H100 with XLA's triangular solve, which the
reference's doubling solve has since cut to 37.0 / 56.3 (BENCHMARKS.md; W = 257 not yet timed).

The block inverse is blockwise doubling (``_unit_lower_inverse``): log2(block) - 1 levels of two
dots instead of ``block`` dependent row reductions. The dots take float32 inputs and accumulate
in float32 at ``BlockSizes.precision``: "tf32x3" runs each as three TF32 tensor-core products
(about 2^-21 relative error each; with that rounding emulated, the chunk stays within 2e-7 of
the float64 recurrence at W = 257 and 513), "ieee" on CUDA cores. The interpreter computes every
dot in float32 whatever the precision. W need not be a multiple of ``block``: the last block's
rows past W load as zero (q, k, v, beta, gate and visibility), which makes their U and O zero
and hides them from every real node, with no padded copy of any input.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import is_power_of_two

# "auto" (the reference until the kernel beats XLA: `resolve_impl`), "pallas" (the kernel), "reference"
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

# The float32 dots' input precision: "ieee" (CUDA-core FMAs) or "tf32x3" (each dot as three
# TF32 tensor-core products, hi*hi + hi*lo + lo*hi, about 2^-21 relative error per product).
DotPrecision = Literal["ieee", "tf32x3"]
PRECISIONS: tuple[str, ...] = get_args(DotPrecision)

# The reference's products on a GPU: TF32x3 for float32 (about 2^-21 relative error a product, on
# the TF32 tensor cores of Ampere and newer; XLA's CPU backend refuses the algorithm), IEEE
# elsewhere and for float64.
def default_dots(dtype: jnp.dtype, backend: str | None = None) -> DotPrecision:
    """The dot precision ``tree_gdn_reference`` uses for ``dtype`` on ``backend`` (default: jax's)."""
    on_gpu = (backend or jax.default_backend()) == "gpu"
    return "tf32x3" if on_gpu and jnp.dtype(dtype) == jnp.float32 else "ieee"


def _xla_precision(dots: DotPrecision) -> lax.Precision | lax.DotAlgorithmPreset:
    if dots not in PRECISIONS:
        raise ValueError(f"tree_gdn_reference: dots must be one of {', '.join(PRECISIONS)}, got {dots!r}")
    return _HI if dots == "ieee" else lax.DotAlgorithmPreset.TF32_TF32_F32_X3


# The rows of the doubling inverse's first blocks, which come from XLA's triangular solve.
_SOLVE_BLOCK = 16


def _diagonal_blocks(x: jax.Array, size: int) -> jax.Array:
    """[..., n, n] -> [..., n / size, size, size]: x's diagonal blocks of `size` (dividing n)."""
    lead, count = x.shape[:-2], x.shape[-1] // size
    blocks = x.reshape(lead + (count, size, count, size))
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


def _unit_lower_inverse_xla(a: jax.Array, precision: lax.Precision | lax.DotAlgorithmPreset) -> jax.Array:
    """(I + a)^-1 for strictly lower triangular a [..., n, n] (n a power of two) by blockwise
    doubling: the inverse's diagonal blocks of size 2s are [[T1, 0], [-T2 a21 T1, T2]] from those
    of size s, so log2(n / 16) levels of two batched products, each of blocks of the true inverse
    (nothing grows past it). The first blocks, of 16 rows (or n), come from XLA's triangular solve."""
    lead, n = a.shape[:-2], a.shape[-1]
    size = min(_SOLVE_BLOCK, n)
    eye = jnp.broadcast_to(jnp.eye(size, dtype=a.dtype), lead + (n // size, size, size))
    # unit_diagonal: the solver never reads a's (zero) diagonal.
    inverse = jax.scipy.linalg.solve_triangular(_diagonal_blocks(a, size), eye, lower=True, unit_diagonal=True)
    while size < n:
        pairs = inverse.reshape(lead + (n // (2 * size), 2, size, size))
        first, second = pairs[..., 0, :, :], pairs[..., 1, :, :]
        a21 = _diagonal_blocks(a, 2 * size)[..., size:, :size]
        low = -jnp.einsum("...ij,...jk,...kl->...il", second, a21, first, precision=precision)
        inverse = jnp.concatenate([jnp.concatenate([first, jnp.zeros_like(first)], -1),
                                   jnp.concatenate([low, second], -1)], -2)
        size *= 2
    return inverse.reshape(lead + (n, n))


def _unit_lower_solve(a: jax.Array, rhs: jax.Array, precision: lax.Precision | lax.DotAlgorithmPreset
                      ) -> jax.Array:
    """U with (I + a) U = rhs: a [..., W, W] strictly lower triangular, rhs [..., W, dv].

    Node 0 has no ancestors, so U_0 = rhs_0, and the other W - 1 rows (padded to a power of two,
    with rows that are their own solution) are the product of their inverse
    (`_unit_lower_inverse_xla`) with the right-hand side. XLA's triangular solve of the whole
    system walks its rows (5 launches at W = 257); at Qwen3.6-27B's GDN shape on an H100 the
    doubling made the chunk faster at every W with either dot precision (BENCHMARKS.md,
    "The tree-GDN verify")."""
    width = a.shape[-1]
    root = rhs[..., :1, :]
    if width == 1:
        return root
    rows = width - 1
    n = 1 << (rows - 1).bit_length()
    pad = [(0, 0)] * (a.ndim - 2) + [(0, n - rows)]
    rest = jnp.pad(rhs[..., 1:, :] - a[..., 1:, :1] * root, pad + [(0, 0)])
    inverse = _unit_lower_inverse_xla(jnp.pad(a[..., 1:, 1:], pad + [(0, n - rows)]), precision)
    u = jnp.einsum("...ts,...sv->...tv", inverse, rest, precision=precision)
    return jnp.concatenate([root, u[..., :rows, :]], -2)


def tree_gdn_reference(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array,
                       visible: jax.Array, state0: jax.Array, dots: DotPrecision | None = None
                       ) -> tuple[jax.Array, jax.Array]:
    """The WY form over W nodes in jnp, computed in state0's dtype.

    Args:
      q, k: [batch, Hk, W, dk], L2-normalised (q also scaled); value head h reads key head
        h // (Hv // Hk).
      v: [batch, Hv, W, dv]; beta: [batch, Hv, W]; decay: [batch, Hv, W], G(t).
      visible: [batch or 1, W, W] bool, ancestor-or-self (every row sees itself; causal for a
        prefill chunk).
      state0: [batch, Hv, dk, dv], the state before the nodes.
      dots: the products' precision (``DotPrecision``; "tf32x3": float32 on a GPU only); None:
        ``default_dots`` for state0's dtype.
    Returns:
      (O, U), both [batch, Hv, W, dv] in state0's dtype.
    """
    batch, key_heads, value_heads, width, dk, dv, group = _check_shapes(q, k, v, beta, decay, visible, state0)
    dtype = state0.dtype
    precision = _xla_precision(default_dots(dtype) if dots is None else dots)
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
    # K and Q go through each product together, [K; Q] with 2W rows: one launch for K K^T and
    # Q K^T, one for K S0 and Q S0 (the verify's products are small and launch-bound).
    kq = jnp.concatenate([k, q], axis=2)
    gram = jnp.einsum("bhtk,bhsk->bhts", kq, k, precision=precision)[:, :, None]
    s0_products = jnp.einsum("bhtk,bhgkv->bhgtv", kq, s0, precision=precision)
    a = jnp.where(strict, beta[..., None] * gram[..., :width, :] * d, 0)
    e = jnp.exp(decay)[..., None]
    rhs = beta[..., None] * (v - e * s0_products[..., :width, :])
    u = _unit_lower_solve(a, rhs, precision)
    scores = gram[..., width:, :] * d
    out = e * s0_products[..., width:, :] + jnp.einsum("bhgts,bhgsv->bhgtv", scores, u, precision=precision)
    out, u = (x.reshape(batch, value_heads, width, dv) for x in (out, u))
    return out, u


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the two kernels.

    block: rows per block (a power of two >= 16); the last block may run past W (its rows there
      are masked). W <= block runs the block kernel alone.
    block_v: value columns per step of the block kernel and per program of the substitution (a
      power of two >= 16 dividing dv): the substitution is independent column by column.
    num_warps, num_stages: Triton's, for both kernels.
    precision: the dots' input precision (``PRECISIONS``).
    share_keys: one block-kernel program per key head for its GQA group of value heads, which
      makes the Gram blocks (two fifths of the block kernel's FLOPs at W = 257) once for the
      group, against one program per value head (group times the programs to overlap each
      other's latencies).
    """
    block: int
    block_v: int
    num_warps: int
    num_stages: int
    precision: DotPrecision
    share_keys: bool


# Columns of dk per step of the block kernel's products over dk.
_BLOCK_K = 32
# Programs that count as filling an H200's 132 SMs.
_FULL_GRID = 128
# The substitution holds its W x block_v values of U in registers: at most this many (128 a
# thread at 4 warps).
_HELD_U = 16384
# The substitution is unrolled over the row blocks: at most this many (W = 1 + 256 in blocks of
# 16, W = 1 + 512 in blocks of 32).
MAX_BLOCKS = 17


def default_block_sizes(batch: int, value_heads: int, width: int, dk: int, dv: int) -> BlockSizes:
    """Block sizes for a shape, chosen by what ptxas reports for sm_90a (registers and spills)
    at the Qwen3.6-27B GDN shape; the timings of BENCHMARKS.md ("The tree-GDN verify") check them.

    block: 16 rows up to MAX_BLOCKS blocks (W <= 272), else 32. At W = 257 the substitution
    spilled 9 KB a thread in blocks of 32 (block_v 32; 732 bytes at block_v 16) against 16 bytes
    in blocks of 16, and the block kernel none in blocks of 16 (at W = 513, in blocks of 32 at
    block_v 16, the substitution still spills 12 KB). block_v: dv split (down to 32
    columns) until the substitution's grid has _FULL_GRID programs, since batch 1 at 48 value
    heads has 48 programs of whole heads, which would leave most of an H200's SMs idle, and
    (down to 16 columns) until its U fits _HELD_U values. TF32x3 dots: IEEE float32 dots run on
    CUDA cores at a small fraction of the tensor cores' rate.
    """
    del dk
    block = _MIN_BLOCK if pl.cdiv(width, _MIN_BLOCK) <= MAX_BLOCKS else 32
    rows = pl.cdiv(width, block) * block
    block_v = dv
    while (block_v > 32 and batch * value_heads * (dv // block_v) < _FULL_GRID) or (
            block_v > _MIN_BLOCK and rows * block_v > _HELD_U):
        block_v //= 2
    return BlockSizes(block=block, block_v=block_v, num_warps=4, num_stages=2, precision="tf32x3", share_keys=False)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

Dot = Callable[[jax.Array, jax.Array, int], jax.Array]


def _dot_fn(precision: DotPrecision, interpret: bool) -> Dot:
    """x @ y (contract_y 0) or x @ y^T (contract_y 1) with float32 accumulation. The interpreter
    runs every dot at HIGHEST: XLA's CPU backend refuses the TF32 algorithms."""
    algorithm = _HI if interpret or precision == "ieee" else lax.DotAlgorithmPreset.TF32_TF32_F32_X3

    def dot(x: jax.Array, y: jax.Array, contract_y: int) -> jax.Array:
        return lax.dot_general(x, y, (((1,), (contract_y,)), ((), ())), precision=algorithm,
                               preferred_element_type=jnp.float32)

    return dot


def _masked_decay(g_rows: jax.Array, g_cols: jax.Array, seen: jax.Array) -> jax.Array:
    """D = exp(G(t) - G(s)) where seen, else 0; masked before the exp (it may be positive off
    the mask and overflow)."""
    return jnp.where(seen, jnp.exp(jnp.where(seen, g_rows[:, None] - g_cols[None, :], 0.0)), 0.0)


def _unit_lower_inverse(a: jax.Array, rows: jax.Array, cols: jax.Array, dot: Dot) -> jax.Array:
    """(I + a)^-1 for a strictly lower triangular [n, n] tile (n a power of two), by blockwise
    doubling: with T the inverse's diagonal blocks of size s, the blocks of size 2s are

        [[T11, 0], [-T22 a21 T11, T22]] = T - T E T,  E = a's [s, s] blocks below T's diagonal
                                                          inside each [2s, 2s] diagonal block,

    log2(n) - 1 levels of two [n, n] dots (the first level needs none), against n dependent
    masked row reductions for forward substitution. Every product is of blocks of the true
    inverse, so nothing grows beyond it (unlike the product of (I + a^(2^m)) factors, whose
    powers grow like binomials when keys align and gates are near 1).
    """
    def below(size: int) -> jax.Array:
        """Row in the lower half and column in the upper half of the same [2s, 2s] block."""
        return ((rows ^ cols) < 2 * size) & ((rows & size) != 0) & ((cols & size) == 0)

    # Size 1: T = I, so T - T E T = I - E without a dot.
    inverse = jnp.where(rows == cols, 1.0, 0.0) - jnp.where(below(1), a, 0.0)
    size = 2
    while size < a.shape[0]:
        inverse = inverse - dot(inverse, dot(jnp.where(below(size), a, 0.0), inverse, 0), 0)
        size *= 2
    return inverse


def _load(ref, idx: tuple, valid: jax.Array | None) -> jax.Array:
    """ref[idx], zero where ``valid`` (None: everywhere valid) is False: rows of a last, partial
    block past the end of the W nodes."""
    if valid is None:
        return ref[idx]
    return plgpu.load(ref.at[idx], mask=valid, other=jnp.zeros((), ref.dtype))


def _block_kernel(q_ref, k_ref, v_ref, beta_ref, decay_ref, vis_ref, s0_ref, u0_ref, o0_ref, at_ref, pt_ref,
                  *, block: int, block_v: int, block_k: int, width: int, dot: Dot):
    """Row block i of one sequence and of `heads` value heads of one key head (the leading axis of
    every value-head ref): everything that does not need another block's U.

    Per value head, u0 = T_i rhs_i, o0 = exp(G) Q_i S0 + P_ii u0 (final when W <= block), and for
    each earlier block j, At_ij = T_i A_ij and Pt_ij = P_ij - P_ii At_ij, so that
    U_i = u0 - sum_j At_ij U_j and O_i = o0 + sum_j Pt_ij U_j. The Gram blocks K_i K_j^T and
    Q_i K_j^T are made once for the heads. Rows past W (in the last block) load as zero: their
    q, k, v, beta, gate and visibility, so their u0 and o0 are zero and no real node sees them.

    Every product over dk runs as a loop over `block_k` columns, loading its operands' slices
    in the loop: only [block, block] and [block, block_v] accumulators stay in registers. Held
    whole, q_i and k_i ([block, dk] each, split in two for the TF32x3 products and repeated
    across the warps of a small-M tensor-core product) spilled from registers, which made this
    kernel about 20x slower than XLA at W = 257 on an H100.
    """
    heads = v_ref.shape[0]
    i = pl.program_id(2)
    start = pl.multiple_of(i * block, block)
    rows_i = pl.ds(start, block)
    rows = lax.broadcasted_iota(jnp.int32, (block, block), 0)
    cols = lax.broadcasted_iota(jnp.int32, (block, block), 1)
    real = None if width % block == 0 else start + lax.broadcasted_iota(jnp.int32, (block,), 0) < width

    def real_rows(columns: int) -> jax.Array | None:
        return None if real is None else jnp.broadcast_to(real[:, None], (block, columns))

    steps_k = k_ref.shape[-1] // block_k

    def chunk(c):
        return pl.ds(pl.multiple_of(c * block_k, block_k), block_k)

    def gram(rows_j, real_j):
        """(K_i K_j^T, Q_i K_j^T), [block, block] each."""
        def step(c, acc):
            k_i = _load(k_ref, (rows_i, chunk(c)), real_rows(block_k))
            q_i = _load(q_ref, (rows_i, chunk(c)), real_rows(block_k))
            k_j = _load(k_ref, (rows_j, chunk(c)), real_j)
            return acc[0] + dot(k_i, k_j, 1), acc[1] + dot(q_i, k_j, 1)
        zero = jnp.zeros((block, block), jnp.float32)
        return lax.fori_loop(0, steps_k, step, (zero, zero))

    def state_products(h, cols_v):
        """(K_i S0, Q_i S0) for value head h and columns cols_v, [block, block_v] each."""
        def step(c, acc):
            s0 = s0_ref[h, chunk(c), cols_v]
            k_i = _load(k_ref, (rows_i, chunk(c)), real_rows(block_k))
            q_i = _load(q_ref, (rows_i, chunk(c)), real_rows(block_k))
            return acc[0] + dot(k_i, s0, 0), acc[1] + dot(q_i, s0, 0)
        zero = jnp.zeros((block, block_v), jnp.float32)
        return lax.fori_loop(0, steps_k, step, (zero, zero))

    seen_ii = _load(vis_ref, (rows_i, rows_i), None if real is None else real[:, None] & real[None, :]) != 0
    kk_ii, qk_ii = gram(rows_i, real_rows(block_k))
    betas, gates, inverses, scores = [], [], [], []
    for h in range(heads):
        # (An array index: the interpreter's masked load takes no Python int beside a slice.)
        head = jnp.int32(h)
        beta_i = _load(beta_ref, (head, rows_i), real)[:, None]
        g_i = _load(decay_ref, (head, rows_i), real)
        d_ii = _masked_decay(g_i, g_i, seen_ii)
        p_ii = qk_ii * d_ii
        t_i = _unit_lower_inverse(jnp.where(rows > cols, beta_i * kk_ii * d_ii, 0.0), rows, cols, dot)
        e_i = jnp.exp(g_i)[:, None]

        def columns(c, carry, h=h, head=head, beta_i=beta_i, t_i=t_i, p_ii=p_ii, e_i=e_i):
            cols_v = pl.ds(pl.multiple_of(c * block_v, block_v), block_v)
            ks0, qs0 = state_products(h, cols_v)
            v_i = _load(v_ref, (head, rows_i, cols_v), real_rows(block_v))
            u0 = dot(t_i, beta_i * (v_i - e_i * ks0), 0)
            u0_ref[h, :, cols_v] = u0
            o0_ref[h, :, cols_v] = e_i * qs0 + dot(p_ii, u0, 0)
            return carry

        lax.fori_loop(0, v_ref.shape[-1] // block_v, columns, 0)
        betas.append(beta_i)
        gates.append(g_i)
        inverses.append(t_i)
        scores.append(p_ii)

    def earlier(j, carry):
        # No branch on whether block j holds an ancestor: where none does, D = 0 makes At and Pt
        # zero, and a loop of plain loads and dots is one Triton can pipeline (num_stages).
        # Block j < i is whole: only this block's rows can run past W.
        cols_j = pl.ds(pl.multiple_of(j * block, block), block)
        seen = _load(vis_ref, (rows_i, cols_j), real_rows(block)) != 0
        kk, qk = gram(cols_j, None)
        for h in range(heads):
            d = _masked_decay(gates[h], decay_ref[h, cols_j], seen)
            at = dot(inverses[h], betas[h] * kk * d, 0)
            at_ref[h, j] = at
            pt_ref[h, j] = qk * d - dot(scores[h], at, 0)
        return carry

    if width > block:  # (else no block has an earlier one, and k_ref holds fewer than `block` rows)
        lax.fori_loop(0, i, earlier, 0)


def _substitution_kernel(at_ref, pt_ref, u0_ref, o0_ref, u_ref, o_ref, *, block: int, num_blocks: int, dot: Dot):
    """Block forward substitution over one (sequence, value head, block of value columns):
    U_i = u0_i - sum_{j < i} At_ij U_j and O_i = o0_i + sum_{j < i} Pt_ij U_j.

    Unrolled over the blocks (their number is static), so every finished U_j stays in registers:
    no store and volatile read-back through global memory, no barrier, and one basic block in
    which every At and Pt load and every product with an older U_j can be issued early. The
    chain that remains is one [block, block] x [block, block_v] dot per block (U_i needs
    At_{i,i-1} U_{i-1} last).
    """
    done = []
    for i in range(num_blocks):
        rows_i = pl.ds(i * block, block)
        u, o = u0_ref[rows_i, :], o0_ref[rows_i, :]
        for j, u_j in enumerate(done):
            u = u - dot(at_ref[i, j], u_j, 0)
            o = o + dot(pt_ref[i, j], u_j, 0)
        u_ref[rows_i, :] = u
        o_ref[rows_i, :] = o
        done.append(u)


def tree_gdn_pallas(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array,
                    visible: jax.Array, state0: jax.Array, *, block: int | None = None,
                    block_v: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    precision: DotPrecision | None = None, share_keys: bool | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The verify chunk as Pallas Triton kernels; same contract as ``tree_gdn_reference``.

    The block kernel's grid is (batch, Hv, W / block) ((batch, Hk, W / block) with share_keys),
    the substitution's (batch, Hv, dv / block_v); key head h // group and a visibility shared by
    the batch are read through the index maps, and a last, partial block masks its loads: no
    input is copied.
    Computes in float32 and returns (O, U) in float32. dk and dv must be powers of two >= 16
    (Qwen3.5 / 3.6: 128). Tiling left as None comes from ``default_block_sizes``.
    """
    batch, key_heads, value_heads, width, dk, dv, group = _check_shapes(
        q, k, v, beta, decay, visible, state0)
    blocks = default_block_sizes(batch, value_heads, width, dk, dv)
    given = (("block", block), ("block_v", block_v), ("num_warps", num_warps), ("num_stages", num_stages),
             ("precision", precision), ("share_keys", share_keys))
    blocks = dataclasses.replace(blocks, **{n: x for n, x in given if x is not None})
    for name, size in (("dk", dk), ("dv", dv), ("block", blocks.block), ("block_v", blocks.block_v)):
        if size < _MIN_BLOCK or not is_power_of_two(size):
            raise ValueError(f"tree_gdn_pallas: {name}={size} must be a power of two >= {_MIN_BLOCK} (Triton)")
    if blocks.block_v > dv:
        raise ValueError(f"tree_gdn_pallas: block_v={blocks.block_v} exceeds dv={dv}")
    if pl.cdiv(width, blocks.block) > MAX_BLOCKS:
        raise ValueError(f"tree_gdn_pallas: W={width} in blocks of {blocks.block} is {pl.cdiv(width, blocks.block)} "
                         f"blocks, more than {MAX_BLOCKS} (the substitution is unrolled over them): use a larger block")
    if blocks.precision not in PRECISIONS:
        raise ValueError(f"tree_gdn_pallas: precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {blocks.precision!r}")
    f32 = jnp.float32
    bt, bv = blocks.block, blocks.block_v
    num_blocks = pl.cdiv(width, bt)
    padded = num_blocks * bt
    dot = _dot_fn(blocks.precision, interpret)
    params = plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages)
    sq = _squeezed()
    # Block-kernel programs over (batch, Hv / heads, nb), each for `heads` value heads of one key head.
    heads = group if blocks.share_keys else 1
    key_spec = pl.BlockSpec((sq, sq, width, dk), lambda b, h, i: (b, h * heads // group, 0, 0))
    gate_spec = pl.BlockSpec((sq, heads, width), lambda b, h, i: (b, h, 0))
    vis_spec = pl.BlockSpec((sq, width, width), (lambda b, h, i: (b, 0, 0)) if visible.shape[0] > 1
                            else (lambda b, h, i: (0, 0, 0)))
    rows_spec = pl.BlockSpec((sq, heads, bt, dv), lambda b, h, i: (b, h, i, 0))
    pairs = jax.ShapeDtypeStruct((batch, value_heads, num_blocks, num_blocks, bt, bt), f32)
    # u0, o0, U and O keep the padded rows (zero): a slice of a kernel's output fuses into its
    # consumer, where a padded input would be a copy of its own.
    nodes = jax.ShapeDtypeStruct((batch, value_heads, padded, dv), f32)
    u0, o0, at, pt = pl.pallas_call(
        functools.partial(_block_kernel, block=bt, block_v=bv, block_k=min(dk, _BLOCK_K), width=width, dot=dot),
        grid=(batch, value_heads // heads, num_blocks),
        in_specs=[key_spec, key_spec, pl.BlockSpec((sq, heads, width, dv), lambda b, h, i: (b, h, 0, 0)),
                  gate_spec, gate_spec, vis_spec, pl.BlockSpec((sq, heads, dk, dv), lambda b, h, i: (b, h, 0, 0))],
        out_specs=[rows_spec, rows_spec] + [
            pl.BlockSpec((sq, heads, sq, num_blocks, bt, bt), lambda b, h, i: (b, h, i, 0, 0, 0))] * 2,
        out_shape=[nodes, nodes, pairs, pairs],
        compiler_params=params,
        interpret=interpret,
        name="tree_gdn_blocks",
    )(q.astype(f32), k.astype(f32), v.astype(f32), beta.astype(f32), decay.astype(f32),
      visible.astype(jnp.int8), state0.astype(f32))
    if num_blocks == 1:
        return o0[:, :, :width], u0[:, :, :width]
    columns_spec = pl.BlockSpec((sq, sq, padded, bv), lambda b, h, c: (b, h, 0, c))
    pairs_spec = pl.BlockSpec((sq, sq, num_blocks, num_blocks, bt, bt), lambda b, h, c: (b, h, 0, 0, 0, 0))
    u, out = pl.pallas_call(
        functools.partial(_substitution_kernel, block=bt, num_blocks=num_blocks, dot=dot),
        grid=(batch, value_heads, dv // bv),
        in_specs=[pairs_spec, pairs_spec, columns_spec, columns_spec],
        out_specs=[columns_spec, columns_spec],
        out_shape=[nodes, nodes],
        compiler_params=params,
        interpret=interpret,
        name="tree_gdn_substitution",
    )(at, pt, u0, o0)
    return out[:, :, :width], u[:, :, :width]


# --------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------

def kernel_takes(dk: int, dv: int) -> bool:
    """Whether the kernel takes these head sizes (powers of two >= 16)."""
    return all(n >= _MIN_BLOCK and is_power_of_two(n) for n in (dk, dv))


def resolve_impl(impl: GdnImpl = "auto", backend: str | None = None) -> str:
    """What ``tree_gdn`` runs for ``impl``: "auto" is "reference" (XLA) on every backend.

    The kernels run only when asked for ("pallas", "interpret"): "auto" moves to them on a GPU
    once they beat XLA at every W of the GDN verify bench. They do not: at the Qwen3.6-27B GDN
    shape, batch 1, their chunk took 48.9 / 97.5 us against XLA's 38.9 / 58.6 us at W = 16 / 64
    on an H100, and XLA's is faster now (BENCHMARKS.md, "The tree-GDN verify"). ``backend`` is
    accepted so that callers need not special-case it.
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
