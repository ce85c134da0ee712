"""An exact `jax.lax.top_k` over long rows in two launches (Pallas, Triton backend).

DDTree's tree takes the top k of every draft depth's log-probs over the vocabulary: rows
[batch x 15, 151936] for Qwen3, k = min(budget, vocab) up to 512. An XLA preselection took
about 103 us of kernel time at k 256 on an H200: a chunk-max reduce, then four preselection
levels, each ranking about a thousand chunk maxima with an [n, m, m] compare-and-sum, cumsums
and gathers; an XLA radix select took 106 us, its counting passes running as slow reductions. Here the whole selection is two
Triton kernels:

1. `_maxima_kernel`, programs over (row, block of chunks): each reads `chunks_per_program`
   chunks of `chunk` entries (4096 floats), turns them into int32 order keys (top_k's total
   order of floats, `_order_key`) and writes each chunk's largest key. This is the only pass
   over the whole row (9 MB at [15, 151936]), spread over a few hundred programs.
2. `_select_kernel`, `split` programs per row, each doing the row's whole selection (the
   extra ones only to share the final ranking; they write private scratch):
   a. the exact k-th best chunk maximum `mu` (ties by lower chunk index) among the row's
      maxima, held in registers (`_kth_largest`: a bisection of the key range counting the
      keys at or above the midpoint, with early exits, about 11 passes on log-probs);
   b. the k chosen chunks (maxima above mu, then the lowest-index ones equal to it),
      compacted in ascending order by a cumulative count into a scratch list;
   c. the candidates: the chosen chunks' entries whose key is >= mu, compacted in ascending
      index order (about k of them on log-probs, at most k x chunk);
   d. the exact k-th largest candidate key `tau` the same way (starting from [mu, row max]),
      and the selection: keys above tau, then the lowest-index keys equal to it: exactly k;
   e. the k selected ranked by compare-count (higher key first, equal keys by lower index;
      this program's share of the k, against all of them) and written at their ranks: the
      values (the keys turned back into floats, bit for bit) and int32 indices.

Why exact: the row's top k (higher key first, ties by lower index) lies in the k chunks
whose maxima rank highest by (key, chunk index) -- an entry left out lies in a chunk that k
chosen chunks outrank, and each of their maxima outranks the entry (a higher key, or an equal
one at a lower index); its k-th key tau is >= mu, because the k chosen maxima are k entries >= mu; so
the top k lies among the candidates, and the candidates' top k is the row's. Padding (past
the row's end, and maxima past the last chunk) takes the lowest key INT32_MIN at the highest
positions, so it ranks after every real entry, a real INT32_MIN (-NaN with every bit set)
included.

Cost at [15, 151936], k 256, chunk 32 (4748 chunks, 8192 in registers): kernel 1 is 570
programs of 4096 entries; kernel 2 is 30 programs (15 rows x 2 shares), each about 11
counting passes over 8192 maxima (32 keys a thread at 8 warps), one gather of 256 x 32
entries (L2 hits: kernel 1 just read them), about 11 passes over about 270 candidates and a
[128, 256] compare-count. No sort, no atomics, no XLA op between the two launches. Measured
on an H200: 25.4 us at k 256 and 39.0 at k 512 against the XLA way's 102.7 and 205.1
(BENCHMARKS.md).

In interpret mode (CPU tests) a masked-off lane of a store writes back the old value, which
could undo a real lane's write to the same place; so every scatter here sends its idle lanes
to a trash slot past the scratch's data, and the output stores have no idle lanes (lanes past
k repeat lane k-1: the same place, the same value).

`top_k_reference` is the same method in jnp (chunk maxima, the top k chunks, candidates >=
mu, their top k), whose contract, like the kernels', is `jax.lax.top_k` itself.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.powers_of_two import next_power_of_two

INT_MIN = np.iinfo(np.int32).min
INT_MAX = np.iinfo(np.int32).max
# Entries per chunk at most (a power of two): 32 keeps both selections small at Qwen3's
# vocabulary (4748 maxima, about k candidates); shorter where the row has fewer than k * 32.
CHUNK = 32
# Entries one `_maxima_kernel` program reads (a power of two): 16 KiB of float32.
MAXIMA_BLOCK = 4096
# Chunk maxima one `_select_kernel` program holds in registers (padded to a power of two).
MAX_CHUNKS = 16384
MAX_K = 2048
# Entries of the candidate list at most (k padded x chunk).
MAX_CANDIDATES = 65536
# Entries gathered at once from the chosen chunks.
GATHER_BLOCK = 4096
# The final ranking: rows (selected entries) per step, and the columns compared at once.
RANK_ROWS = 128
RANK_COLS = 64
# Programs per row share the final ranking, RANK_ROWS rows each at most, while rows x shares
# stays within this (about the H200's 132 SMs).
MAX_PROGRAMS = 128
MAXIMA_WARPS = 4
SELECT_WARPS = 8


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static sizes of one call: rows [n, length], top k.

    chunk: entries per chunk (power of two, length // chunk >= k); n_chunks: ceil(length /
    chunk); per_program: chunks a `_maxima_kernel` program reads; maxima: chunk-maxima slots
    written (n_chunks rounded up to per_program); maxima_block: n_chunks padded to a power of
    two (registers of `_select_kernel`); k_block: k padded to a power of two; capacity:
    candidate slots (k_block x chunk); tile: candidates held in registers (the rest are read
    back per pass); split: `_select_kernel` programs per row.
    """

    n: int
    length: int
    k: int
    chunk: int
    n_chunks: int
    per_program: int
    maxima: int
    maxima_block: int
    k_block: int
    capacity: int
    tile: int
    split: int


def _prev_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def plan(n: int, length: int, k: int, chunk: int = CHUNK, split: int | None = None) -> Plan | None:
    """The sizes for rows [n, length] and top k (1 <= k <= length), or None where the kernels
    do not apply (k > MAX_K, or more than MAX_CHUNKS maxima or MAX_CANDIDATES candidates).

    chunk: the largest chunk to use (a power of two); the chunk is the largest power of two
    <= chunk with length // chunk >= k, so that k chunks exist. split: programs per row
    (a power of two dividing k_block; default: the k rows in shares of RANK_ROWS while rows x
    shares <= MAX_PROGRAMS).
    """
    if not 1 <= k <= min(length, MAX_K):
        return None
    chunk = min(_prev_power_of_two(chunk), _prev_power_of_two(length // k))
    n_chunks = -(-length // chunk)
    # A longer row than MAX_CHUNKS chunks of `chunk` takes longer chunks while k of them fit.
    while next_power_of_two(n_chunks) > MAX_CHUNKS and 2 * chunk <= length // k:
        chunk *= 2
        n_chunks = -(-length // chunk)
    maxima_block = next_power_of_two(n_chunks)
    k_block = next_power_of_two(k)
    capacity = k_block * chunk
    if maxima_block > MAX_CHUNKS or capacity > MAX_CANDIDATES:
        return None
    per_program = min(max(1, MAXIMA_BLOCK // chunk), maxima_block)
    if split is None:
        split = 1
        while (2 * split * RANK_ROWS <= k_block and n * 2 * split <= MAX_PROGRAMS):
            split *= 2
    elif split < 1 or split & (split - 1) or k_block % split:
        raise ValueError(f"split must be a power of two dividing k padded ({k_block}), got {split}")
    return Plan(n=n, length=length, k=k, chunk=chunk, n_chunks=n_chunks, per_program=per_program,
                maxima=-(-n_chunks // per_program) * per_program, maxima_block=maxima_block,
                k_block=k_block, capacity=capacity, tile=min(capacity, max(32, 2 * k_block)),
                split=split)


def applies(length: int, k: int) -> bool:
    """Whether `top_k` takes rows of this length and this k (see `plan`)."""
    return plan(1, length, k) is not None


# ----------------------------------------------------------------------------------------------
# Keys: top_k's total order of floats as signed int32 order.

def _order_key(x: jax.Array) -> jax.Array:
    """int32 keys whose signed order is top_k's order of the float32 values: -NaN < -inf < ...
    < -0.0 < +0.0 < ... < +inf < +NaN (the negative floats' 31 low bits flipped)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(INT_MAX), bits)


def _key_value(key: jax.Array) -> jax.Array:
    """The float32 whose `_order_key` is `key` (the flip is its own inverse), bit for bit."""
    return lax.bitcast_convert_type(jnp.where(key < 0, key ^ jnp.int32(INT_MAX), key), jnp.float32)


def _count(mask: jax.Array) -> jax.Array:
    """int32 scalar: the true entries of a bool block."""
    return jnp.sum(mask.astype(jnp.int32))


def _kth_largest(k: int, lo: jax.Array, hi: jax.Array, c_lo: jax.Array,
                 count_ge: Callable[[jax.Array], jax.Array],
                 nearest: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """int32 scalar: the k-th largest key of a multiset X (counted with repeats).

    Start: lo <= the answer <= hi = max X, c_lo = #{x >= lo} >= k. count_ge(t) = #{x >= t};
    nearest(up, lo, hi) = min{x >= lo} if up else max{x <= hi}.
    Invariant: the answer is in [lo, hi], #{x >= lo} = c_lo >= k > g_hi = #{x > hi}. A pass
    counts the keys at or above the midpoint and keeps the half holding the answer. It stops
    when the interval is one key, or when no other key lies on one side of the answer: c_lo ==
    k (the answer is the least key >= lo) or g_hi == k - 1 (the greatest key <= hi). At most 32
    passes; on log-probs about 11 over a few thousand keys.
    hi - lo may exceed the int32 range: it wraps, and the logical shift reads it unsigned.
    """
    def cond(state):
        lo, hi, c_lo, g_hi = state
        return (lo != hi) & (c_lo != k) & (g_hi != k - 1)

    def body(state):
        lo, hi, c_lo, g_hi = state
        mid = lo + lax.shift_right_logical(hi - lo, jnp.int32(1)) + 1     # in (lo, hi]
        c = count_ge(mid)
        up = c >= k
        return (jnp.where(up, mid, lo), jnp.where(up, hi, mid - 1), jnp.where(up, c, c_lo),
                jnp.where(up, g_hi, c))

    lo, hi, c_lo, g_hi = lax.while_loop(cond, body, (lo, hi, c_lo, jnp.int32(0)))
    return jnp.where(lo == hi, lo, nearest(c_lo == k, lo, hi))


def _nearest_in(x: jax.Array, valid: jax.Array | None, up: jax.Array, lo: jax.Array,
                hi: jax.Array) -> jax.Array:
    """One block's part of `_kth_largest`'s nearest, as a max: of ~x (= -x - 1, which reverses
    the signed order without overflow) over {x >= lo} when up, else of x over {x <= hi};
    INT32_MIN where the block has none. The caller combines blocks with max and undoes ~."""
    inside = jnp.where(up, x >= lo, x <= hi)
    if valid is not None:
        inside = inside & valid
    return jnp.max(jnp.where(inside, jnp.where(up, ~x, x), jnp.int32(INT_MIN)))


def _packed_counts(gt: jax.Array, eq: jax.Array, axis: int = 0) -> tuple[jax.Array, jax.Array]:
    """Inclusive running counts of gt and eq along `axis` in one cumsum (16 bits each; blocks
    here hold < 65536 entries)."""
    running = jnp.cumsum(gt.astype(jnp.int32) + (eq.astype(jnp.int32) << 16), axis=axis)
    return running & 0xFFFF, running >> 16


# ----------------------------------------------------------------------------------------------
# Kernel 1: chunk maxima.

def _maxima_kernel(rows_ref, maxima_ref, *, p: Plan):
    """Program (row, b): chunks b * per_program + [0, per_program) of the row.

    rows_ref [n, length] float32; maxima_ref [n, maxima] int32: each chunk's largest order key
    (INT32_MIN for chunks past the row's end; past its end, entries count as INT32_MIN).
    """
    row, b = pl.program_id(0), pl.program_id(1)
    chunks = b * p.per_program + jnp.arange(p.per_program, dtype=jnp.int32)
    idx = chunks[:, None] * p.chunk + jnp.arange(p.chunk, dtype=jnp.int32)[None, :]
    ok = idx < p.length
    x = plgpu.load(rows_ref.at[row, idx], mask=ok, other=0.0)
    key = jnp.where(ok, _order_key(x), jnp.int32(INT_MIN))
    plgpu.store(maxima_ref.at[row, chunks], jnp.max(key, axis=1))


# ----------------------------------------------------------------------------------------------
# Kernel 2: the selection, one row per program (times `split`).

def _select_kernel(rows_ref, maxima_ref, val_ref, idx_ref, chunk_ref, cand_key_ref, cand_idx_ref,
                   sel_key_ref, sel_idx_ref, *, p: Plan, barrier: bool):
    """Program (row, part): the row's top k; ranks rows part * k_block / split + [0, ...) of it.

    rows_ref [n, length] float32; maxima_ref [n, maxima] int32 (kernel 1); outputs val_ref
    [n, k] float32, idx_ref [n, k] int32; scratch (row * split + part's own row, the last slot
    a trash slot for idle lanes): chunk_ref [n * split, k_block + 1] chosen chunk ids;
    cand_key_ref, cand_idx_ref [n * split, capacity + 1] candidates; sel_key_ref, sel_idx_ref
    [n * split, k_block + 1] the k selected, in ascending index order.
    """
    row, part = pl.program_id(0), pl.program_id(1)
    me = row * p.split + part
    k = p.k

    def sync():
        if barrier:  # this program's scratch writes are seen by all its threads
            plgpu.debug_barrier()

    # a. mu: the k-th best chunk maximum.
    c = jnp.arange(p.maxima_block, dtype=jnp.int32)
    have = c < p.maxima
    mx = plgpu.load(maxima_ref.at[row, c], mask=have, other=INT_MIN)
    top = jnp.max(mx)

    def maxima_nearest(up, lo, hi):
        m = _nearest_in(mx, None, up, lo, hi)
        return jnp.where(up, ~m, m)

    mu = _kth_largest(k, jnp.min(mx), top, jnp.int32(p.maxima_block),
                      lambda t: _count(mx >= t), maxima_nearest)

    # b. The chosen chunks: above mu, then the lowest-index ones equal to it.
    gt, eq = mx > mu, mx == mu
    need = k - _count(gt)
    gt_incl, eq_incl = _packed_counts(gt, eq)
    chosen = gt | (eq & (eq_incl <= need))
    slot = gt_incl + jnp.minimum(eq_incl, need) - 1
    plgpu.store(chunk_ref.at[me, jnp.where(chosen, slot, p.k_block)], c, mask=chosen)
    sync()

    # c. The candidates: the chosen chunks' entries >= mu, in ascending index order.
    per = max(1, min(p.k_block, GATHER_BLOCK // p.chunk))
    count = jnp.int32(0)
    for t in range(-(-k // per)):
        slots = t * per + jnp.arange(per, dtype=jnp.int32)
        real = slots < k
        ids = plgpu.load(chunk_ref.at[me, slots], mask=real, other=0)
        idx = ids[:, None] * p.chunk + jnp.arange(p.chunk, dtype=jnp.int32)[None, :]
        ok = real[:, None] & (idx < p.length)
        key = _order_key(plgpu.load(rows_ref.at[row, idx], mask=ok, other=0.0))
        take = ok & (key >= mu)
        within = jnp.cumsum(take.astype(jnp.int32), axis=1)
        in_chunk = jnp.sum(take.astype(jnp.int32), axis=1)
        before = jnp.cumsum(in_chunk) - in_chunk
        at = jnp.where(take, count + before[:, None] + within - 1, p.capacity)
        plgpu.store(cand_key_ref.at[me, at], key, mask=take)
        plgpu.store(cand_idx_ref.at[me, at], idx, mask=take)
        count = count + jnp.sum(in_chunk)
    sync()

    # d. tau: the k-th largest candidate; the first `tile` candidates stay in registers, the
    # rest (only where ties fill many chunks) are read back per pass.
    q = jnp.arange(p.tile, dtype=jnp.int32)
    live = q < count
    x0 = plgpu.load(cand_key_ref.at[me, q], mask=live, other=INT_MIN)
    more = p.capacity > p.tile
    n_tiles = lax.div(count + p.tile - 1, jnp.int32(p.tile))

    def over_tiles(first: jax.Array, part_of: Callable[[jax.Array, jax.Array], jax.Array],
                   combine: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
        """first (the register tile's part) combined with part_of(keys, live) of every other tile."""
        if not more:
            return first

        def body(j, acc):
            pos = j * p.tile + q
            ok = pos < count
            x = plgpu.load(cand_key_ref.at[me, pos], mask=ok, other=INT_MIN)
            return combine(acc, part_of(x, ok))

        return lax.fori_loop(1, n_tiles, body, first)

    def cand_count_ge(t):
        return over_tiles(_count(live & (x0 >= t)), lambda x, ok: _count(ok & (x >= t)), jnp.add)

    def cand_nearest(up, lo, hi):
        m = over_tiles(_nearest_in(x0, live, up, lo, hi),
                       lambda x, ok: _nearest_in(x, ok, up, lo, hi), jnp.maximum)
        return jnp.where(up, ~m, m)

    tau = _kth_largest(k, mu, top, count, cand_count_ge, cand_nearest)
    above = over_tiles(_count(live & (x0 > tau)), lambda x, ok: _count(ok & (x > tau)), jnp.add)
    ties = k - above  # equal keys to take, the lowest-index ones

    def select(x, ok, idx, gt_off, eq_off):
        gt, eq = ok & (x > tau), ok & (x == tau)
        gt_incl, eq_incl = _packed_counts(gt, eq)
        gt_incl, eq_incl = gt_incl + gt_off, eq_incl + eq_off
        take = gt | (eq & (eq_incl <= ties))
        at = jnp.where(take, gt_incl + jnp.minimum(eq_incl, ties) - 1, p.k_block)
        plgpu.store(sel_key_ref.at[me, at], x, mask=take)
        plgpu.store(sel_idx_ref.at[me, at], idx, mask=take)
        return gt_off + _count(gt), eq_off + _count(eq)

    idx0 = plgpu.load(cand_idx_ref.at[me, q], mask=live, other=0)
    offsets = select(x0, live, idx0, jnp.int32(0), jnp.int32(0))
    if more:
        def select_tile(j, offsets):
            pos = j * p.tile + q
            ok = pos < count
            x = plgpu.load(cand_key_ref.at[me, pos], mask=ok, other=INT_MIN)
            idx = plgpu.load(cand_idx_ref.at[me, pos], mask=ok, other=0)
            return select(x, ok, idx, *offsets)

        lax.fori_loop(1, n_tiles, select_tile, offsets)
    sync()

    # e. This program's share of the k, ranked against all k and written at its ranks. Lanes
    # past k repeat lane k - 1 (same rank, same value), so the stores need no mask.
    share = p.k_block // p.split
    rows_at_once = min(RANK_ROWS, share)
    cols = min(RANK_COLS, p.k_block)
    for s in range(share // rows_at_once):
        i = jnp.minimum(part * share + s * rows_at_once + jnp.arange(rows_at_once, dtype=jnp.int32),
                        k - 1)
        ki = plgpu.load(sel_key_ref.at[me, i])
        xi = plgpu.load(sel_idx_ref.at[me, i])

        def rank_cols(jt, rank, i=i, ki=ki):
            j = jt * cols + jnp.arange(cols, dtype=jnp.int32)
            real = j < k
            kj = plgpu.load(sel_key_ref.at[me, j], mask=real, other=INT_MIN)
            ahead = real[None, :] & ((kj[None, :] > ki[:, None])
                                     | ((kj[None, :] == ki[:, None]) & (j[None, :] < i[:, None])))
            return rank + jnp.sum(ahead.astype(jnp.int32), axis=1)

        rank = lax.fori_loop(0, -(-k // cols), rank_cols, jnp.zeros((rows_at_once,), jnp.int32))
        plgpu.store(val_ref.at[row, rank], _key_value(ki))
        plgpu.store(idx_ref.at[row, rank], xi)


# ----------------------------------------------------------------------------------------------
# The call.

def _check(rows: Any, k: Any) -> tuple[int, int, int]:
    if getattr(rows, "ndim", None) != 2:
        raise ValueError(f"top_k: rows must be [n, length], got shape {getattr(rows, 'shape', None)}")
    if not jnp.issubdtype(rows.dtype, jnp.floating) or jnp.dtype(rows.dtype).itemsize > 4:
        raise ValueError(f"top_k: rows must be float32 or narrower floats, got {rows.dtype}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"top_k: k must be a Python int (static), got {type(k).__name__}: {k!r}")
    n, length = rows.shape
    if not 0 <= k <= length:
        raise ValueError(f"top_k: k must be in 0..{length} (the row length), got {k}")
    return n, length, int(k)


def top_k(rows: jax.Array, k: int, *, chunk: int = CHUNK, split: int | None = None,
          maxima_warps: int = MAXIMA_WARPS, select_warps: int = SELECT_WARPS,
          interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k(rows, k)`: values (bit for bit) and int32 indices, in top_k's order
    (higher first, equal values by lower index, floats ordered totally: -NaN < -inf < -0.0 <
    +0.0 < +inf < NaN), in two Triton launches.

    Args:
      rows: [n, length] float32 (bfloat16 / float16 are widened, exactly, and the values
        narrowed back).
      k: static int, 0 <= k <= length; `applies(length, k)` must hold for k >= 1.
      chunk: the largest chunk of the preselection (a power of two; see `plan`).
      split: programs per row sharing the final ranking (default: see `plan`).
      maxima_warps, select_warps: warps of the two kernels' programs.
      interpret: run the kernels in Pallas' interpreter (CPU tests).
    Returns:
      (values [n, k] of rows' dtype, indices [n, k] int32).
    """
    n, length, k = _check(rows, k)
    if k == 0 or n == 0:
        return jnp.zeros((n, k), rows.dtype), jnp.zeros((n, k), jnp.int32)
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"top_k: chunk must be an int >= 1, got {chunk!r}")
    p = plan(n, length, k, int(chunk), split)
    if p is None:
        raise ValueError(f"top_k: k={k} over rows of {length} is outside the kernels' limits "
                         f"(k <= {MAX_K}, <= {MAX_CHUNKS} chunk maxima, <= {MAX_CANDIDATES} "
                         "candidates); see applies()")
    dtype = rows.dtype
    x = rows.astype(jnp.float32)
    maxima = pl.pallas_call(
        functools.partial(_maxima_kernel, p=p),
        grid=(n, p.maxima // p.per_program),
        out_shape=jax.ShapeDtypeStruct((n, p.maxima), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=maxima_warps, num_stages=1),
        interpret=interpret,
        name="top_k_chunk_maxima",
    )(x)
    scratch = n * p.split
    i32 = jnp.int32
    val, idx, *_ = pl.pallas_call(
        functools.partial(_select_kernel, p=p, barrier=not interpret),
        grid=(n, p.split),
        out_shape=(jax.ShapeDtypeStruct((n, k), jnp.float32), jax.ShapeDtypeStruct((n, k), i32),
                   jax.ShapeDtypeStruct((scratch, p.k_block + 1), i32),
                   jax.ShapeDtypeStruct((scratch, p.capacity + 1), i32),
                   jax.ShapeDtypeStruct((scratch, p.capacity + 1), i32),
                   jax.ShapeDtypeStruct((scratch, p.k_block + 1), i32),
                   jax.ShapeDtypeStruct((scratch, p.k_block + 1), i32)),
        compiler_params=plgpu.CompilerParams(num_warps=select_warps, num_stages=1),
        interpret=interpret,
        name="top_k_select",
    )(x, maxima)
    return val.astype(dtype), idx


# ----------------------------------------------------------------------------------------------
# The method in jnp.

def top_k_reference(rows: jax.Array, k: int, chunk: int = CHUNK) -> tuple[jax.Array, jax.Array]:
    """The kernels' method in jnp, whose contract is `jax.lax.top_k(rows, k)`: the chunk
    maxima of the order keys, the top k chunks by (maximum, chunk index), their entries >= the
    k-th maximum mu as candidates (the rest of a chosen chunk drops to the lowest key, after
    every candidate), and lax.top_k over those (k x chunk slots, ascending index order).
    rows [n, length] float32; 1 <= k; `applies(length, k)`."""
    n, length, k = _check(rows, k)
    p = plan(n, length, k, chunk)
    if p is None:
        raise ValueError(f"top_k_reference: k={k} over rows of {length} is outside the kernels' limits")
    keys = _order_key(rows.astype(jnp.float32))
    blocks = jnp.pad(keys, ((0, 0), (0, p.n_chunks * p.chunk - length)),
                     constant_values=INT_MIN).reshape(n, p.n_chunks, p.chunk)
    maxima, chosen = lax.top_k(jnp.max(blocks, axis=2), k)
    chosen = jnp.sort(chosen, axis=1)
    mu = maxima[:, -1:, None]
    cand = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1)
    cand = jnp.where(cand >= mu, cand, INT_MIN).reshape(n, k * p.chunk)
    where = (chosen[:, :, None] * p.chunk + jnp.arange(p.chunk)[None, None, :]).reshape(n, k * p.chunk)
    _, pos = lax.top_k(cand, k)
    idx = jnp.take_along_axis(where, pos, axis=1).astype(jnp.int32)
    return jnp.take_along_axis(rows, idx, axis=1), idx
