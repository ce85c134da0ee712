"""Tree attention: the one attention of the target model (prefill, AR decode, chain and tree verify).

The W new tokens of each sequence already have their K/V written into the cache at slots
``L_b .. L_b+W-1``. Query ``t`` of sequence ``b`` sees key slot ``j`` iff ``j < L_b`` (the
committed prefix) or ``L_b <= j < L_b+W`` and ``visible[b, t, j-L_b]`` (its tree ancestors and
itself; causal when ``visible`` is None).

This file holds, side by side:

* ``tree_attention_reference``: plain jnp, a masked softmax over every cache slot.
* ``tree_attention_pallas``: a Pallas kernel on the Triton GPU backend (flash attention with an
  online softmax, GQA heads folded into rows, optional split-K over the prefix).
* ``default_block_sizes``: the block sizes the dispatcher uses for a shape on a GPU
  (``GpuLimits``: its SMs and shared memory, read from the device).
* ``_combine_splits``: the split-K merge (jnp, after the kernel).
* ``hopper_applies``: where the dispatcher takes the Hopper kernel instead
  (``tree_attention_hopper.py``: Mosaic GPU, for wide trees on sm_90); ``rows_schedule`` and
  ``tree_attention_rows``: the same for a caller that hands q over in that kernel's row layout
  (the model, from ``qkv_epilogue.py``).
* ``tree_attention``: the dispatcher.
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

from pallas_kernels import tree_attention_hopper as hopper
from pallas_kernels.powers_of_two import is_power_of_two, next_power_of_two

# The implementations `tree_attention` takes: "auto" (by backend, `resolve_impl`); "pallas" (on
# sm_90 the Hopper kernel of `tree_attention_hopper` where it applies, fed by the model's fused
# qkv epilogue, else the Triton kernel); "triton" (the Triton kernel alone: the path of GPUs
# other than Hopper, e.g. Ampere, which this lets a Hopper GPU run and test); "reference" (jnp);
# "interpret" (the Triton kernel in Pallas' interpreter, for CPU tests).
AttentionImpl = Literal["auto", "pallas", "triton", "reference", "interpret"]
IMPLS: tuple[str, ...] = get_args(AttentionImpl)

# exp2 is the native GPU instruction; folding log2(e) into the score scale makes exp2 exact
# replacement for exp.
_LOG2E = 1.4426950408889634
# The running max starts finite so that a row whose keys are all masked (-inf) never computes
# (-inf) - (-inf) = NaN; any real score is far above it.
_M_INIT = -1e30
# Triton's dot needs at least 16 rows and 16 columns per operand.
_MIN_BLOCK = 16
# Accumulator elements a warp holds in the tuned tiles (64 rows x 128 dims over 4 warps: 64
# float32 registers a thread), and the most warps a program gets.
_ACC_ELEMENTS_PER_WARP = 64 * 128 // 4
_MAX_WARPS = 8
# Programs that count as filling an H200's 132 SMs without split-K (W = 256 at 8 kv heads has
# 128 programs of 64 rows).
_FULL_GRID = 128


def _is_triton_block(size: int) -> bool:
    """Whether a block dimension (or the head size) suits the Triton kernel: a power of two >= 16."""
    return size >= _MIN_BLOCK and is_power_of_two(size)


def _squeezed():
    """The block-shape marker for a squeezed dimension (``pl.squeezed`` on newer jax)."""
    return getattr(pl, "squeezed", None)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                  visible: jax.Array | None) -> tuple[int, int, int, int, int, int]:
    """Returns (batch, width, q_heads, kv_heads, head_dim, max_len); raises on a mismatch."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be rank 4, got {q.shape}, {k.shape}, {v.shape}")
    batch, width, q_heads, head_dim = q.shape
    kb, max_len, kv_heads, kd = k.shape
    if k.shape != v.shape or kb != batch or kd != head_dim:
        raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    if prefix_lens.shape != (batch,):
        raise ValueError(f"prefix_lens must be [batch]={batch}, got {prefix_lens.shape}")
    if width > max_len:
        raise ValueError(f"width={width} exceeds the cache length max_len={max_len}")
    if visible is not None and visible.shape != (batch, width, width):
        raise ValueError(f"visible must be [batch, width, width]={(batch, width, width)}, "
                         f"got {visible.shape}")
    return batch, width, q_heads, kv_heads, head_dim, max_len


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------

def key_visibility(prefix_lens: jax.Array, visible: jax.Array | None, width: int,
                   max_len: int) -> jax.Array:
    """Which cache slots each new token sees.

    Args:
      prefix_lens: [batch] int32 committed lengths L_b.
      visible: [batch, width, width] bool tree visibility, or None for causal.
    Returns:
      [batch, width, max_len] bool: slot j is visible to token t of sequence b.
    """
    j = jnp.arange(max_len)[None, None, :]
    lens = prefix_lens.astype(jnp.int32)[:, None, None]
    s = j - lens  # position of slot j inside the tree block; negative for the prefix
    in_tree = (s >= 0) & (s < width)
    if visible is None:
        tree_ok = s <= jnp.arange(width)[None, :, None]
    else:
        batch = prefix_lens.shape[0]
        s_idx = jnp.broadcast_to(jnp.clip(s, 0, width - 1), (batch, width, max_len))
        tree_ok = jnp.take_along_axis(visible.astype(bool), s_idx, axis=2)
    return (j < lens) | (in_tree & tree_ok)


def tree_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                             visible: jax.Array | None = None, *,
                             scale: float | None = None) -> jax.Array:
    """Masked softmax attention over every cache slot, in float32.

    Args:
      q: [batch, width, q_heads, head_dim] queries of the W new tokens.
      k, v: [batch, max_len, kv_heads, head_dim] one layer's cache (new tokens already written).
      prefix_lens: [batch] int32 committed lengths L_b (L_b + width <= max_len).
      visible: [batch, width, width] bool, or None for causal among the new tokens.
      scale: score scale, default head_dim ** -0.5.
    Returns:
      [batch, width, q_heads, head_dim] in q's dtype; rows that see no key are 0.
    """
    batch, width, q_heads, kv_heads, head_dim, max_len = _check_shapes(q, k, v, prefix_lens,
                                                                       visible)
    group = q_heads // kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(batch, width, kv_heads, group, head_dim)
    scores = jnp.einsum("btkgd,bjkd->bkgtj", qg, k.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * scale
    seen = key_visibility(prefix_lens, visible, width, max_len)[:, None, None, :, :]
    scores = jnp.where(seen, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    # where() again on the weights: masked slots may hold garbage (even NaN) in k and v.
    weights = jnp.where(seen, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    slot_used = jnp.any(seen, axis=(1, 2, 3))[:, :, None, None]  # [batch, max_len, 1, 1]
    v32 = jnp.where(slot_used, v.astype(jnp.float32), 0.0)
    out = jnp.einsum("bkgtj,bjkd->btkgd", weights, v32, precision=lax.Precision.HIGHEST)
    denom = jnp.moveaxis(denom, 3, 1)  # [batch, width, kv_heads, group, 1]
    out = jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)
    return out.reshape(batch, width, q_heads, head_dim).astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the Pallas kernel.

    block_q: rows per program (rows = query tokens x the group's q heads); a power of two >= 16.
    block_k: keys per loop step; a power of two >= 16.
    split_k: programs sharing one row block's keys (flash-decoding); 1 = no split.
    tail_split: 0 or 1 for one launch; more (with split_k 1): the split-K of each kv head's
      last row block, run as a second launch after the others (see `_tail_split`).
    """
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    tail_split: int = 0


@dataclasses.dataclass(frozen=True)
class GpuLimits:
    """What the tiling needs to know of a GPU: SMs, and shared memory (bytes) a block may opt in
    to and an SM holds."""
    num_sms: int
    smem_per_block: int
    smem_per_sm: int

    @property
    def smem_budget(self) -> int:
        """Shared memory a program's tiles may take; the rest is slack for Triton's scratch."""
        return self.smem_per_block - 7 * 1024

    def resident_programs(self, smem: int) -> int:
        """Programs of `smem` bytes each that run at once: one wave of the grid."""
        return self.num_sms * max(1, self.smem_per_sm // smem)


# An H100 / H200 SXM, where the defaults were tuned; also the limits assumed without a GPU.
H200 = GpuLimits(num_sms=132, smem_per_block=227 * 1024, smem_per_sm=228 * 1024)
# Opt-in shared memory per block and per SM, in KB, by compute capability (CUDA programming
# guide). Consumer Ampere, Ada (the 48 GB L40S / RTX 6000 class) and consumer Blackwell have
# less than half of Hopper's, so Hopper's tiles would not compile there.
_SHARED_KB = {(8, 0): (163, 164), (8, 6): (99, 100), (8, 7): (163, 164), (8, 9): (99, 100),
              (9, 0): (227, 228), (10, 0): (227, 228), (12, 0): (99, 100)}


def limits_of(device) -> GpuLimits:
    """GpuLimits of a jax GPU device, from its compute capability and SM count.

    An architecture not in the table gets the smallest shared memory listed, which compiles
    everywhere at some cost in speed.
    """
    try:
        arch = tuple(int(x) for x in str(device.compute_capability).split(".")[:2])
    except (AttributeError, ValueError):  # e.g. ROCm's gfx names
        arch = None
    per_block, per_sm = _SHARED_KB.get(arch, (99, 100))
    num_sms = getattr(device, "core_count", None) or H200.num_sms
    return GpuLimits(num_sms=int(num_sms), smem_per_block=per_block * 1024, smem_per_sm=per_sm * 1024)


@functools.cache
def gpu_limits() -> GpuLimits:
    """The local GPU's limits; an H200's where there is none (CPU tests, lowering for cuda)."""
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return H200
    return limits_of(device)


def _shared_memory_bytes(block_q: int, block_k: int, head_dim: int, itemsize: int,
                         num_stages: int) -> int:
    """Rough shared memory of one program: pipelined K and V tiles plus the q tile."""
    return (num_stages * 2 * block_k + block_q) * head_dim * itemsize


def default_block_sizes(batch: int, width: int, group: int, kv_heads: int, head_dim: int,
                        max_len: int, itemsize: int = 2, limits: GpuLimits | None = None) -> BlockSizes:
    """Block sizes for a shape. The prefix length is dynamic, so max_len stands in for it.
    limits: the GPU's (default: `gpu_limits()`); tiles shrink to fit its shared memory.

    Tuned on an H200 (jax 0.11.2, bf16, 32/8 heads x 128, the tree-attention benchmark's
    `--sweep`). Rows per kv head are width * group:

    * <= 16 rows (AR decode): a pure K/V stream. 16-row blocks (Triton's minimum for a dot),
      64-key blocks, and split-K to ~512 programs: 8 kv heads alone would use 8 of 132 SMs.
    * <= 64 rows (chains): one row block per kv head, split-K to ~2 programs per SM.
    * more (tree verify), with a 64-row program per SM or more: 64 x 128 tiles with 4 warps beat
      128 x 64 with 8 warps by ~1.5x at W=256/512, and split-K lost once the grid has a program
      per SM (its float32 partials cost more than the idle SMs).
    * more, but fewer 64-row blocks than a full grid (W = 32 to 128 at 8 kv heads): 128 x 64
      tiles with 8 warps (two warpgroups share each K/V tile, halving the K/V reads), split-K to
      one program per SM. At ctx 4K / 16K / 32K, W = 64 took 25.8 / 75.3 / 136.7 us of kernel
      time against 31.3 / 90.4 / 170.2 with the 64 x 128 tiles split 4 ways, side by side
      (BENCHMARKS.md); W = 32 at 4K lost 1.6 us and won 13 us at 32K.

    Split-K never makes the grid larger than one wave of resident programs (132 SMs, programs
    per SM by `_shared_memory_bytes`): a 64 x 128 tile takes ~208 KB, one per SM, so W = 64's
    split of 8-9 ran 2-3 waves; capped at 4 its kernel time went from 39 to 32 us at ctx 4K and
    from 221 to 171 us at 32K (BENCHMARKS.md). A grid just over a wave without
    split-K gets a tail launch (`_tail_split`).
    """
    limits = limits or gpu_limits()
    rows = width * group
    if rows <= _MIN_BLOCK:
        block_q, block_k, num_warps, num_stages, target = _MIN_BLOCK, 64, 4, 2, 512
    elif rows <= 64:
        block_q, block_k, num_warps, num_stages, target = next_power_of_two(rows), 64, 4, 3, 264
    elif batch * kv_heads * pl.cdiv(rows, 64) >= _FULL_GRID:
        block_q, block_k, num_warps, num_stages, target = 64, 128, 4, 3, 264
    else:
        block_q, block_k, num_warps, num_stages, target = 128, 64, 8, 2, limits.num_sms
    # The float32 accumulator of a program's rows, [block_q, head_dim], spread over its threads: the
    # tuned head_dim-128 tiles hold 64 registers a thread (64 rows x 4 warps, 128 x 8). Wider heads
    # (the hybrids' 256) get the warps, then the rows, that keep it there, so that the accumulator,
    # the q tile and the scores stay in the 255 registers a thread has.
    while block_q * head_dim > _ACC_ELEMENTS_PER_WARP * num_warps and block_q > _MIN_BLOCK:
        if num_warps < _MAX_WARPS:
            num_warps *= 2
        else:
            block_q //= 2
    block_q, block_k, num_stages = _fit_shared_memory(block_q, block_k, num_stages, head_dim, itemsize,
                                                      limits.smem_budget)
    block_k = min(block_k, max(_MIN_BLOCK, next_power_of_two(max_len)))
    row_blocks = pl.cdiv(rows, block_q)
    programs = batch * kv_heads * row_blocks
    smem = _shared_memory_bytes(block_q, block_k, head_dim, itemsize, num_stages)
    tail_split = 0
    if programs >= _FULL_GRID:
        split_k = 1
        tail_split = _tail_split(batch * kv_heads, row_blocks, smem, block_k, max_len, limits)
    else:
        # Each split should still stream several key blocks, else the combine costs more.
        split_k = max(1, min(target // programs, limits.resident_programs(smem) // programs,
                             pl.cdiv(max_len, block_k) // 4))
    return BlockSizes(block_q=block_q, block_k=block_k, num_warps=num_warps,
                      num_stages=num_stages, split_k=split_k, tail_split=tail_split)


def _fit_shared_memory(block_q: int, block_k: int, num_stages: int, head_dim: int, itemsize: int,
                       budget: int) -> tuple[int, int, int]:
    """(block_q, block_k, num_stages) shrunk until `_shared_memory_bytes` fits `budget`: key blocks
    down to 32, then pipeline stages down to 2, then key blocks down to 16 (Triton's smallest dot),
    then stages down to 1, then rows. Pipelining and the rows' reuse of each K/V tile go last. At
    head_dim 256 in bf16 on a 99 KB-per-block GPU (the RTX A6000, sm_86) a 64-row program takes
    16-key blocks in 2 stages (64 KB); on an H200 the same program keeps 64-key blocks (160 KB)."""
    def fits() -> bool:
        return _shared_memory_bytes(block_q, block_k, head_dim, itemsize, num_stages) <= budget
    while not fits() and block_k > 32:
        block_k //= 2
    while not fits() and num_stages > 2:
        num_stages -= 1
    while not fits() and block_k > _MIN_BLOCK:
        block_k //= 2
    while not fits() and num_stages > 1:
        num_stages -= 1
    while not fits() and block_q > _MIN_BLOCK:
        block_q //= 2
    if not fits():
        raise ValueError(f"tree attention: head_dim={head_dim} ({itemsize}-byte elements) needs "
                         f"{_shared_memory_bytes(block_q, block_k, head_dim, itemsize, num_stages)} bytes of shared "
                         f"memory at the smallest tiles; this GPU gives a program {budget}")
    return block_q, block_k, num_stages


def _tail_split(heads: int, row_blocks: int, smem: int, block_k: int, max_len: int,
                limits: GpuLimits) -> int:
    """Split-K for each head's last row block when running it as its own launch saves a wave.

    heads: batch * kv_heads; every head has row_blocks blocks of rows. The grid runs in waves of
    SMs x (programs resident per SM). W = 272 (budget 256, group 4, 8 kv heads) has 136
    programs: a full wave plus a wave of 4 that takes as long as the first, so its kernel time
    is twice W = 256's (126 against 60 us at ctx 4K, BENCHMARKS.md). Without
    the last block of each head the rest fits one wave fewer, and the `heads` tail programs,
    split over the keys, fill the SMs for a fraction of a program's time. Returns 0 when that
    saves no wave or the keys are too short to split. Each split streams at least 2 key blocks:
    at ctx 4K that lets W = 272's tail split 16 ways, not 8 (tail 15.1 against 21.5 us of
    kernel time, BENCHMARKS.md).
    """
    slots = limits.resident_programs(smem)
    programs = heads * row_blocks
    if row_blocks < 2 or pl.cdiv(programs - heads, slots) == pl.cdiv(programs, slots):
        return 0
    split = min(max(1, slots // heads), pl.cdiv(max_len, block_k) // 2)
    return split if split >= 2 else 0


# --------------------------------------------------------------------------------------------
# Pallas kernel
# --------------------------------------------------------------------------------------------

def _block_rows(row_block: jax.Array, kv_head: jax.Array, block_q: int, width: int, group: int,
                head_dim: int) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """The rows of one program: (token [block_q], row_ok [block_q], index into [width, q_heads, head_dim]).

    Row r of a kv head is token r // group, q head kv_head * group + r % group, so the group's
    heads share every K/V tile. Padding rows (past width * group) repeat real (token, head)
    pairs so that every index stays in bounds.
    """
    rows = row_block * block_q + jnp.arange(block_q, dtype=jnp.int32)
    row_ok = rows < width * group
    token = jnp.minimum(rows // group, width - 1)
    head = kv_head * group + rows % group
    # All-integer indexers: interpret mode cannot mix index arrays with slices.
    dims = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    return token, row_ok, (token[:, None], head[:, None], dims)


def _store_rows(o_ref, q_index: tuple[jax.Array, ...], row_ok: jax.Array, out: jax.Array,
                interpret: bool) -> None:
    """Writes a program's [block_q, head_dim] rows into the [width, q_heads, head_dim] output.

    A padding row repeats a real row's (token, head) and holds the same values, so storing it
    too is harmless. Interpret mode needs that: its masked scatter writes the old contents back
    at masked duplicates, which could clobber the real row.
    """
    mask = None if interpret else row_ok[:, None]
    plgpu.store(o_ref.at[q_index], out.astype(o_ref.dtype), mask=mask)


def _tree_attention_kernel(lens_ref, q_ref, k_ref, v_ref, *refs, width: int, group: int,
                           block_q: int, block_k: int, split_k: int, first_block: int, qk_scale: float,
                           has_visible: bool, interpret: bool):
    """One program: one sequence, one kv head, one block of rows, one split of the keys.

    The grid's row blocks are first_block, first_block + 1, ... of the kv head's rows.

    Refs (batch and head dims squeezed by the BlockSpecs):
      lens_ref: [1] int32 L_b.
      q_ref: [width, q_heads, head_dim] this sequence's queries.
      k_ref, v_ref: [max_len, head_dim] this sequence's and kv head's cache.
      vis_ref (if has_visible): [width, width] int8 tree visibility.
      outputs, split_k == 1: o_ref [width, q_heads, head_dim].
      outputs, split_k > 1: acc_ref [block_q, head_dim] f32 (unnormalised), m_ref and l_ref
        [block_q] f32 (running max in log2 units and sum of exp2).
    """
    if has_visible:
        vis_ref, *out_refs = refs
    else:
        vis_ref, out_refs = None, refs
    kv_head = pl.program_id(1)
    row_block = pl.program_id(2) + first_block
    split = pl.program_id(3)
    prefix_len = lens_ref[0]
    tree_end = prefix_len + width

    token, row_ok, q_index = _block_rows(row_block, kv_head, block_q, width, group, q_ref.shape[-1])
    q = q_ref[q_index]  # [block_q, head_dim] gather

    # Key blocks [0, num_clean) lie wholly in the prefix and need no mask; the rest, up to the
    # end of the tree, are masked. Split s takes a contiguous share of all blocks.
    num_clean = prefix_len // block_k
    num_blocks = pl.cdiv(tree_end, block_k)
    per_split = pl.cdiv(num_blocks, split_k)
    lo = split * per_split
    hi = jnp.minimum(lo + per_split, num_blocks)
    key_offsets = jnp.arange(block_k, dtype=jnp.int32)
    # float32 inputs get true float32 products (newer jax defaults Triton dots to tf32).
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def step(block, carry, masked: bool):
        acc, m_prev, l_prev = carry
        start = block * block_k
        keys = start + key_offsets
        if masked:
            # Slots at or past L+W may hold anything (even NaN); never read them.
            in_range = (keys < tree_end)[:, None]
            k_tile = plgpu.load(k_ref.at[pl.ds(start, block_k), :], mask=in_range, other=0.0)
            v_tile = plgpu.load(v_ref.at[pl.ds(start, block_k), :], mask=in_range, other=0.0)
        else:
            # plgpu.load rather than ref[...]: its interpret-mode rule tolerates a block that
            # runs past max_len (only ever traced then, never executed).
            k_tile = plgpu.load(k_ref.at[pl.ds(start, block_k), :])
            v_tile = plgpu.load(v_ref.at[pl.ds(start, block_k), :])
        scores = lax.dot_general(q, k_tile, (((1,), (1,)), ((), ())), precision=precision,
                                 preferred_element_type=jnp.float32) * qk_scale
        if masked:
            tree_pos = keys - prefix_len  # [block_k]; negative inside the prefix
            if has_visible:
                col = jnp.clip(tree_pos, 0, width - 1)
                vis = vis_ref[token[:, None], col[None, :]] != 0  # [block_q, block_k] gather
                in_tree = (tree_pos >= 0) & (keys < tree_end)
                seen = (tree_pos < 0)[None, :] | (in_tree[None, :] & vis)
            else:
                # Causal: slot L+s is seen by token t iff s <= t (prefix slots have s < 0).
                seen = tree_pos[None, :] <= token[:, None]
            scores = jnp.where(seen, scores, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(scores - m_next[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v_tile.dtype), v_tile, (((1,), (0,)), ((), ())),
                             precision=precision, preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_next, l_next

    head_dim = q_ref.shape[-1]
    carry = (jnp.zeros((block_q, head_dim), jnp.float32),
             jnp.full((block_q,), _M_INIT, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    carry = lax.fori_loop(lo, jnp.minimum(hi, num_clean),
                          functools.partial(step, masked=False), carry)
    carry = lax.fori_loop(jnp.maximum(lo, num_clean), hi,
                          functools.partial(step, masked=True), carry)
    acc, m_i, l_i = carry

    if split_k == 1:
        (o_ref,) = out_refs
        _store_rows(o_ref, q_index, row_ok, _normalise(acc, l_i), interpret)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m_i
        l_ref[...] = l_i


def _normalise(acc: jax.Array, l: jax.Array) -> jax.Array:
    """acc / l per row; a row that saw no key (l = 0) is 0, not NaN."""
    return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)


def _combine_splits(acc: jax.Array, m: jax.Array, l: jax.Array, width: int, group: int,
                    dtype: jnp.dtype) -> jax.Array:
    """Merges split-K partials.

    Args:
      acc: [batch, kv_heads, split_k, rows_padded, head_dim] f32 unnormalised outputs of the
        rows of `width` tokens (a tail launch: the last `width` tokens).
      m, l: [batch, kv_heads, split_k, rows_padded] f32 running max (log2 units) and sum.
    Returns:
      [batch, width, kv_heads * group, head_dim] in dtype.
    """
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp2(m - m_all)  # empty splits have m = _M_INIT and l = 0: weight irrelevant
    denom = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    out = jnp.where(denom[..., None] > 0, num / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
    batch, kv_heads, _, head_dim = out.shape
    out = out[:, :, :width * group].reshape(batch, kv_heads, width, group, head_dim)
    out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(batch, width, kv_heads * group, head_dim)
    return out.astype(dtype)


def _kernel_call(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                 visible: jax.Array | None, *, group: int, blocks: BlockSizes, first_block: int,
                 row_blocks: int, split_k: int, scale: float, interpret: bool):
    """One launch of the kernel over row blocks [first_block, first_block + row_blocks) of every
    (sequence, kv head).

    Returns, split_k == 1: [batch, width, q_heads, head_dim] with those blocks' rows written
    (the others undefined); split_k > 1: the partials (acc, m, l) that `_combine_splits` takes,
    with rows_padded = row_blocks * block_q.
    """
    batch, width, q_heads, head_dim = q.shape
    max_len, kv_heads = k.shape[1], k.shape[2]
    block_q = blocks.block_q
    grid = (batch, kv_heads, row_blocks, split_k)
    sq = _squeezed()
    in_specs = [
        pl.BlockSpec((1,), lambda b, h, i, s: (b,)),
        pl.BlockSpec((sq, width, q_heads, head_dim), lambda b, h, i, s: (b, 0, 0, 0)),
        pl.BlockSpec((sq, max_len, sq, head_dim), lambda b, h, i, s: (b, 0, h, 0)),
        pl.BlockSpec((sq, max_len, sq, head_dim), lambda b, h, i, s: (b, 0, h, 0)),
    ]
    args = [prefix_lens.astype(jnp.int32), q, k, v]
    if visible is not None:
        in_specs.append(pl.BlockSpec((sq, width, width), lambda b, h, i, s: (b, 0, 0)))
        args.append(visible.astype(jnp.int8))
    if split_k == 1:
        # Programs of one sequence write disjoint rows of the same output block.
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
        out_specs = pl.BlockSpec((sq, width, q_heads, head_dim), lambda b, h, i, s: (b, 0, 0, 0))
    else:
        padded = row_blocks * block_q
        out_shape = (
            jax.ShapeDtypeStruct((batch, kv_heads, split_k, padded, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, split_k, padded), jnp.float32),
            jax.ShapeDtypeStruct((batch, kv_heads, split_k, padded), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((sq, sq, sq, block_q, head_dim), lambda b, h, i, s: (b, h, s, i, 0)),
            pl.BlockSpec((sq, sq, sq, block_q), lambda b, h, i, s: (b, h, s, i)),
            pl.BlockSpec((sq, sq, sq, block_q), lambda b, h, i, s: (b, h, s, i)),
        )
    kernel = functools.partial(
        _tree_attention_kernel, width=width, group=group, block_q=block_q, block_k=blocks.block_k,
        split_k=split_k, first_block=first_block, qk_scale=float(scale) * _LOG2E,
        has_visible=visible is not None, interpret=interpret)
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name="tree_attention" if first_block == 0 else "tree_attention_tail",
    )(*args)


def tree_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                          visible: jax.Array | None = None, *, scale: float | None = None,
                          block_q: int | None = None, block_k: int | None = None,
                          num_warps: int | None = None, num_stages: int | None = None,
                          split_k: int | None = None, tail_split: int | None = None,
                          interpret: bool = False) -> jax.Array:
    """Tree attention as a Pallas Triton kernel; same contract as ``tree_attention_reference``.

    Grid: (batch, kv_heads, row blocks, split_k). Block sizes left as None come from
    ``default_block_sizes``. tail_split > 1 (with split_k 1) runs each kv head's last row block
    as a second launch with that split-K; it is skipped when there is one row block, or when
    the last block does not start at a token boundary (block_q * blocks not a multiple of the
    group). Split-K partials merge in XLA (`_combine_splits`).
    visible may be bool or int8 (the kernel reads int8; int8 saves a convert per call).
    """
    batch, width, q_heads, kv_heads, head_dim, max_len = _check_shapes(q, k, v, prefix_lens,
                                                                       visible)
    group = q_heads // kv_heads
    defaults = default_block_sizes(batch, width, group, kv_heads, head_dim, max_len,
                                   jnp.dtype(k.dtype).itemsize)
    given = dict(block_q=block_q, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
                 split_k=split_k, tail_split=tail_split)
    if split_k is not None and tail_split is None:
        given["tail_split"] = 0  # an explicit tiling runs as one launch unless asked otherwise
    blocks = dataclasses.replace(defaults, **{k_: v_ for k_, v_ in given.items() if v_ is not None})
    for name, size in (("block_q", blocks.block_q), ("block_k", blocks.block_k), ("head_dim", head_dim)):
        if not _is_triton_block(size):
            raise ValueError(f"{name}={size} must be a power of two >= {_MIN_BLOCK} (Triton)")
    if blocks.split_k < 1:
        raise ValueError(f"split_k={blocks.split_k} must be >= 1")
    if blocks.tail_split < 0 or (blocks.tail_split > 1 and blocks.split_k > 1):
        raise ValueError(f"tail_split={blocks.tail_split} must be >= 0, and needs split_k=1 "
                         f"(got split_k={blocks.split_k})")
    scale = head_dim ** -0.5 if scale is None else scale

    row_blocks = pl.cdiv(width * group, blocks.block_q)
    call = functools.partial(_kernel_call, q, k, v, prefix_lens, visible, group=group, blocks=blocks,
                             scale=scale, interpret=interpret)
    tail_rows = (row_blocks - 1) * blocks.block_q
    if blocks.tail_split > 1 and row_blocks > 1 and tail_rows % group == 0:
        out = call(first_block=0, row_blocks=row_blocks - 1, split_k=1)
        first_token = tail_rows // group
        partials = call(first_block=row_blocks - 1, row_blocks=1, split_k=blocks.tail_split)
        tail = _combine_splits(*partials, width=width - first_token, group=group, dtype=q.dtype)
        return lax.dynamic_update_slice(out, tail, (0, first_token, 0, 0))
    result = call(first_block=0, row_blocks=row_blocks, split_k=blocks.split_k)
    if blocks.split_k == 1:
        return result
    return _combine_splits(*result, width=width, group=group, dtype=q.dtype)


# --------------------------------------------------------------------------------------------
# Hopper
# --------------------------------------------------------------------------------------------

# Rows per kv head (width x group) from which "pallas" takes the Hopper kernel on sm_90 (one
# warpgroup's 64 rows; an AR step's 4 keep the Triton kernel). At 64 rows (DFlash's 16 tokens x
# group 4, and its drafter) the Hopper kernel made a DFlash round 6.32 ms against 6.72 with the
# Triton kernel, DDTree(16) at W 17 6.53 against 7.05 (H200, in turns; BENCHMARKS.md).
HOPPER_MIN_ROWS = 64
# Widths up to which it does: its mask is a [batch, W x group, ~W] bf16 bias, by its shape 9 MB
# per sequence at W 1024 x group 4 but 138 MB at a 4096-token prefill (sizes computed, not
# measured), which keeps the Triton kernel.
HOPPER_MAX_WIDTH = 1024


def hopper_takes(width: int, q_heads: int, kv_heads: int, head_dim: int, max_len: int, dtype) -> bool:
    """Whether "pallas" runs `tree_attention_hopper` for this shape on this machine: a GPU of
    compute capability 9.x, bf16/f16, head_dim 64 or 128, a cache length that is a multiple of
    8 (the TMA's tiling), at least HOPPER_MIN_ROWS rows per kv head and at most HOPPER_MAX_WIDTH
    new tokens.

    head_dim 256 (the Qwen3.5 / 3.6 hybrids' attention) goes to the Triton kernel, which tiles it
    within both an H200's and an Ampere GPU's shared memory (`default_block_sizes`). The Hopper
    kernel's compute warpgroups run at a fixed 232 registers a thread (`REGISTERS`): a 64 x 256
    float32 output accumulator alone takes 128 of them, and a 64 x 128 score tile 64 more, before
    its softmax state and addresses; and its two 64-row q tiles (64 KB) and 2 stages of 128-key K
    and V tiles (256 KB) would need 320 KB of shared memory, against the 227 KB a block has."""
    return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim in (64, 128)
            and max_len % 8 == 0 and width * (q_heads // kv_heads) >= HOPPER_MIN_ROWS
            and width <= HOPPER_MAX_WIDTH and hopper.available())


def hopper_applies(q: jax.Array, k: jax.Array) -> bool:
    """`hopper_takes` for these arrays (and k in q's dtype)."""
    _, width, q_heads, head_dim = q.shape
    return k.dtype == q.dtype and hopper_takes(width, q_heads, k.shape[2], head_dim, k.shape[1], q.dtype)


def rows_schedule(batch: int, width: int, q_heads: int, kv_heads: int, head_dim: int, max_len: int,
                  dtype, impl: AttentionImpl = "auto") -> hopper.Schedule | None:
    """The Hopper kernel's schedule where `impl` runs it for this shape, else None.

    A caller that gets one may hand q over already in the kernel's row layout
    (`tree_attention_rows`), e.g. straight from `qkv_epilogue`, instead of [batch, W, heads, dim].
    """
    if resolve_impl(impl) != "pallas" or not hopper_takes(width, q_heads, kv_heads, head_dim, max_len, dtype):
        return None
    return hopper_schedule(batch, width * (q_heads // kv_heads), kv_heads, max_len)


def hopper_schedule(batch: int, rows: int, kv_heads: int, max_len: int) -> hopper.Schedule:
    """The Hopper kernel's schedule for `rows` rows per kv head: `hopper.schedule` for this GPU's
    SMs, with a partial block of at most 8 rows folded into the full-block programs
    (`hopper.fold_tail`; the kernel 40.6 against 46.0 us at W 257, ctx 4K, and DDTree(256) 10.87
    against 11.01 ms in turns, BENCHMARKS.md)."""
    return hopper.fold_tail(hopper.schedule(batch, kv_heads, rows, max_len, gpu_limits().num_sms))


def tree_attention_rows(q_rows: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                        visible: jax.Array | None, *, width: int, group: int, sched: hopper.Schedule,
                        scale: float | None = None) -> jax.Array:
    """`tree_attention` on q given as the Hopper kernel's rows (a `rows_schedule` said so).

    q_rows: [batch, kv_heads, sched.padded_rows, head_dim], row = token * group + head in the
    group. Returns [batch, width, q_heads, head_dim].
    """
    scale = q_rows.shape[-1] ** -0.5 if scale is None else scale
    return hopper.attend_rows(q_rows, k, v, prefix_lens, visible, width=width, group=group, scale=scale,
                              sched=sched)


# --------------------------------------------------------------------------------------------
# Dispatcher
# --------------------------------------------------------------------------------------------

def triton_takes(head_dim: int) -> bool:
    """Whether the Triton kernel takes this head size (a power-of-two block of at least 16)."""
    return _is_triton_block(head_dim)


def resolve_impl(impl: AttentionImpl = "auto", backend: str | None = None) -> str:
    """The implementation ``tree_attention`` runs for ``impl`` on ``backend`` (default
    ``jax.default_backend()``): "auto" is "pallas" on a GPU, "reference" elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if impl == "auto":
        return "pallas" if (backend or jax.default_backend()) == "gpu" else "reference"
    return impl


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                   visible: jax.Array | None = None, *, scale: float | None = None,
                   impl: AttentionImpl = "auto") -> jax.Array:
    """Attention of W new tokens over one layer's KV cache (prefix + tree visibility).

    Args:
      q: [batch, width, q_heads, head_dim].
      k, v: [batch, max_len, kv_heads, head_dim]; the new tokens' K/V already at slots
        prefix_lens[b] .. prefix_lens[b]+width-1.
      prefix_lens: [batch] int32.
      visible: [batch, width, width] bool, or None for causal among the new tokens.
      impl: one of `IMPLS`: "auto" (Pallas on GPU where a kernel takes the head size, reference
        elsewhere), "pallas" (on Hopper, the Mosaic GPU kernel where `hopper_applies`, else the
        Triton one), "triton" (the Triton kernel alone), "reference", "interpret".
    Returns:
      [batch, width, q_heads, head_dim] in q's dtype.
    """
    which = resolve_impl(impl)
    if which == "reference" or (impl == "auto" and not hopper_applies(q, k) and not triton_takes(q.shape[-1])):
        # "auto" on a GPU, for a head size neither kernel takes (a tiny test model's 8, say).
        return tree_attention_reference(q, k, v, prefix_lens, visible, scale=scale)
    if which == "pallas" and hopper_applies(q, k):
        _check_shapes(q, k, v, prefix_lens, visible)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        batch, width, q_heads, _ = q.shape
        sched = hopper_schedule(batch, width * (q_heads // k.shape[2]), k.shape[2], k.shape[1])
        return hopper.tree_attention_hopper(q, k, v, prefix_lens, visible, scale=scale, sched=sched)
    return tree_attention_pallas(q, k, v, prefix_lens, visible, scale=scale, interpret=which == "interpret")
