"""Tree attention on Hopper (sm_90): a Pallas Mosaic GPU kernel.

The Triton kernel (`tree_attention.py`) reaches about a third of an H200's bf16 tensor rate on
the rows of a 256-node tree. This kernel puts the rows of one kv head (W tokens x the group's q
heads, so the group shares every K/V tile) through `wgmma`, with K/V streamed by the tensor
memory accelerator (TMA), in a warp-specialised block:

* two compute warpgroups, 64 rows each (128 rows per block), each running an online softmax in
  registers, taking turns on the tensor cores (one warpgroup's softmax runs while the other's
  products do; 42.7 against 44.7 us at W 272, ctx 4K, with the turns than without); a
  warpgroup whose rows are all padding only keeps step (41.4 us);
* one memory warpgroup streaming K/V tiles into a ring of `stages` shared-memory slots, each
  slot freed by a barrier that both compute warpgroups arrive at;
* a softmax that scales inside exp2's argument (one fused multiply-add per score: 40.1 against
  41.1 us at W 272, ctx 4K, against scaling every score first).

Keys come in blocks of `block_k` aligned to block_k (TMA into tiled shared memory needs starts
the compiler can prove aligned). The blocks before floor(L / block_k) lie in the committed
prefix and need no mask; the rest carry an additive bf16 bias of 0 / -inf (`tree_bias`): the
prefix's tail, then the tree (slots L..L+W-1) under each row's visibility.

Grid (`Schedule`): the rows of each kv head, padded to whole 128-row blocks, are split over the
keys flash-decoding style so that one launch fills the SMs: the full blocks `main_split` ways,
a last partial block (at W 272 x group 4: 64 real rows) `tail_split` ways. Each program writes
its output normalised with its log-sum-exp; `split_merge.py` (a Triton kernel, its grid sized
so that the tail's 16 splits are no long pole) merges them straight into tokens where it takes
the shape, else `merge` does in jnp. The grid numbers every kv head's full-block programs
before any tail program, so the long programs all start in the first wave and the short tail
ones take the SMs as those end (the kernel 39.3 against 40.3 us at W 257, ctx 4K, against
each head's tail programs right after its full ones).

A partial block of at most TAIL_COLS real rows (W 257 x group 4: the 4 rows of the 257th token)
is instead folded into the full-block programs (`Schedule.fold_tail`, `fold_tail`): their memory
warpgroups take it on the K/V tiles they stream, swap-AB (keys on wgmma's M side, the rows on N),
one tail partial per program (the kernel 40.6 against 46.0 us at W 257, ctx 4K).

Needs: bf16/f16, head_dim 64 or 128, a cache length (max_len) that is a multiple of 8, and cache
slots from L+W to the end of the last key block that hold finite values (the TMA reads them
unmasked and the bias hides them; the model's caches start as zeros). `tree_attention.py`
checks the first three before dispatching here.

This file holds, side by side: the schedule, the bias, the kernel (`_kernel`), its launch
(`hopper_partials`), the jnp merge, and `tree_attention_hopper`. The reference is
`tree_attention.tree_attention_reference`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import split_merge

try:  # Mosaic GPU ships with jaxlib; absent on some builds.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jaxlib build
    plgpu = None

ROWS_PER_WG = 64  # wgmma's M per warpgroup
COMPUTE_WGS = 2
ROWS_PER_BLOCK = ROWS_PER_WG * COMPUTE_WGS
# A folded tail's rows on wgmma's N side (`Schedule.fold_tail`): its accumulators then take 8
# registers a thread each.
TAIL_COLS = 8
# Registers a thread (compute warpgroups, memory warpgroup), without and with a folded tail.
# The kernel launches 384 threads at 168 registers (64K / 384, in steps of 8), and a warpgroup
# can only take what another gave back (setmaxnreg), so 2 * compute + memory <= 3 * 168: with
# more, the compute warpgroups wait for registers forever.
REGISTERS = {False: (232, 40), True: (224, 56)}
LAUNCH_REGISTERS = 168
_LOG2E = 1.4426950408889634
# Finite, so a row with no visible key in a step never computes (-inf) - (-inf).
_M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The programs of one (sequence, kv head): `full_blocks` blocks of 128 rows, each split
    `main_split` ways over the keys, then (if `tail`) one partial block split `tail_split` ways.
    block_k: keys per step (a multiple of 64); stages: K/V slots in flight.
    real_rows: rows per kv head that are not padding (a warpgroup of padding only keeps step).
    fold_tail: no tail programs. A partial block of at most `TAIL_COLS` real rows (W 257 x
      group 4: 4 rows) is taken by the memory warpgroups of the full-block programs, on the
      K/V tiles they stream anyway: block i of a kv head by the program of row block
      i % full_blocks, keys on wgmma's M side and the rows on N (swap-AB: S^T = K Q^T,
      O^T = V^T P^T), so the rows cost 8 columns of each product, not a 64-row warpgroup.
      Program p's share is written as tail partial p (tail_split is main_programs). See
      `fold_tail`.
    """
    full_blocks: int
    main_split: int
    tail: bool
    tail_split: int
    real_rows: int
    block_k: int = 128
    stages: int = 2
    fold_tail: bool = False

    @property
    def main_programs(self) -> int:
        return self.full_blocks * self.main_split

    @property
    def programs(self) -> int:
        """Partials per (sequence, kv head): the full-block programs', then the tail's."""
        return self.main_programs + (self.tail_split if self.tail else 0)

    @property
    def launched(self) -> int:
        """Programs launched per (sequence, kv head): with `fold_tail`, the full-block ones."""
        return self.main_programs if self.fold_tail else self.programs

    @property
    def padded_rows(self) -> int:
        return (self.full_blocks + self.tail) * ROWS_PER_BLOCK


def schedule(batch: int, kv_heads: int, rows: int, max_len: int, num_sms: int = 132,
             block_k: int = 128) -> Schedule:
    """The schedule for `rows` rows per kv head.

    A 128-row block takes all of an SM's tensor cores, so the full blocks split over the keys
    until the grid has one program per SM and no more; a partial block splits further, so
    that its programs fill the SMs the full ones leave and end with them. Each split keeps at
    least 2 key blocks of the cache.
    """
    heads = batch * kv_heads
    full, tail = divmod(rows, ROWS_PER_BLOCK)
    cap = max(1, pl.cdiv(max_len, block_k) // 2)
    main_split = max(1, min(num_sms // max(heads * full, 1), cap)) if full else 1
    tail_split = max(1, min(num_sms // heads, cap)) if tail else 1
    return Schedule(full_blocks=full, main_split=main_split, tail=bool(tail), tail_split=tail_split,
                    block_k=block_k, real_rows=rows)


def fold_tail(sched: Schedule) -> Schedule:
    """`sched` with its partial block taken by the full-block programs (`Schedule.fold_tail`)
    where it has both kinds of block and the partial one at most TAIL_COLS real rows; else
    `sched` unchanged."""
    tail_rows = sched.real_rows - sched.full_blocks * ROWS_PER_BLOCK
    if not (sched.full_blocks and sched.tail and 0 < tail_rows <= TAIL_COLS):
        return sched
    return dataclasses.replace(sched, fold_tail=True, tail_split=sched.main_programs)


def available() -> bool:
    """Whether the local backend can run the kernel: a GPU of compute capability 9.x."""
    if plgpu is None or jax.default_backend() != "gpu":
        return False
    cap = str(getattr(jax.local_devices(backend="gpu")[0], "compute_capability", ""))
    return cap.startswith("9.")


def bias_columns(width: int, block_k: int) -> int:
    """Columns of the bias: the key blocks that can hold tree slots, whatever L is."""
    return pl.cdiv(block_k - 1 + width, block_k) * block_k


def tree_bias(visible: jax.Array | None, prefix_lens: jax.Array, width: int, group: int,
              rows: int, block_k: int) -> jax.Array:
    """The additive mask of the key blocks from floor(L / block_k) on: [batch, rows, columns] bf16.

    TMA copies into tiled shared memory need block starts the compiler can prove aligned, so the
    kernel's key blocks are aligned to block_k and the tree (slots L..L+W-1) starts inside one.
    Column x is key slot floor(L / block_k) * block_k + x: 0 where row r (token r // group) sees
    it (a prefix slot, or a tree slot that `visible` allows), -inf otherwise (past the tree).
    visible: [batch, width, width] bool/int8, or None for causal.
    """
    columns = bias_columns(width, block_k)
    batch = prefix_lens.shape[0]
    offset = prefix_lens.astype(jnp.int32) % block_k  # where the tree starts in the first block
    slot = jnp.arange(columns)[None, :] - offset[:, None]  # [batch, columns] tree slot index
    in_tree = (slot >= 0) & (slot < width)
    token = jnp.minimum(jnp.arange(rows) // group, width - 1)  # padding rows: any real token
    index = jnp.broadcast_to(jnp.clip(slot, 0, width - 1)[:, None, :], (batch, rows, columns))
    if visible is None:
        allowed = index <= token[None, :, None]
    else:
        allowed = jnp.take_along_axis(visible.astype(bool)[:, token, :], index, axis=2)
    seen = (slot < 0)[:, None, :] | (in_tree[:, None, :] & allowed)
    return jnp.where(seen, 0.0, -jnp.inf).astype(jnp.bfloat16)


def _transposed(ref):
    """ref viewed as its transpose (the API moved between jax releases)."""
    if hasattr(plgpu, "transpose_ref"):
        return plgpu.transpose_ref(ref, (1, 0))
    return ref.transpose((1, 0))


def head_and_program(sched: Schedule, kv_heads: int, c: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kv head of the program at c on the grid's "program" axis (over kv_heads * programs)
    and its index among that head's programs (as `merge` numbers them: full-block programs,
    then tail ones). Indices below kv_heads * main_programs are the full-block programs, head by
    head; the rest the tail programs, head by head."""
    if not sched.tail or sched.fold_tail:
        n = jnp.int32(sched.main_programs)
        return lax.div(c, n), lax.rem(c, n)
    if not sched.full_blocks:
        n = jnp.int32(sched.tail_split)
        return lax.div(c, n), lax.rem(c, n)
    mains = jnp.int32(kv_heads * sched.main_programs)
    in_tail = c >= mains
    t = jnp.maximum(c - mains, 0)
    head = jnp.where(in_tail, lax.div(t, jnp.int32(sched.tail_split)), lax.div(c, jnp.int32(sched.main_programs)))
    program = jnp.where(in_tail, sched.main_programs + lax.rem(t, jnp.int32(sched.tail_split)),
                        lax.rem(c, jnp.int32(sched.main_programs)))
    return head, program


def _program(sched: Schedule, c: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This program's (row block, split, number of splits) from its index c among its kv head's."""
    if not sched.tail or sched.fold_tail:
        n = jnp.int32(sched.main_split)
        return lax.div(c, n), lax.rem(c, n), n
    if not sched.full_blocks:
        return jnp.int32(0), c, jnp.int32(sched.tail_split)
    in_tail = c >= sched.main_programs
    row_block = jnp.where(in_tail, sched.full_blocks, lax.div(c, jnp.int32(sched.main_split)))
    split = jnp.where(in_tail, c - sched.main_programs, lax.rem(c, jnp.int32(sched.main_split)))
    return row_block, split, jnp.where(in_tail, sched.tail_split, sched.main_split).astype(jnp.int32)


def split_range(split, splits, total):
    """Key blocks [lo, hi) of split `split` of `splits` over a kv head's `total` blocks."""
    per_split = lax.div(total + splits - 1, splits)
    lo = jnp.minimum(split * per_split, total)
    return lo, jnp.minimum(lo + per_split, total)


def takes_tail_block(block, row_block, full_blocks: int):
    """With `Schedule.fold_tail`: whether the program of `row_block` takes key block `block`
    for the partial block's rows. Every program of a split streams the split's blocks; this
    gives each block to one of them."""
    return lax.rem(block, jnp.int32(full_blocks)) == row_block


def _kernel(lens_ref, q_ref, k_ref, v_ref, bias_ref, out_ref, lse_ref, scratch, *, sched: Schedule,
            width: int, kv_heads: int, qk_scale: float):
    """One program: one sequence, one kv head, 128 rows, one split of the key blocks.

    Key block j holds slots j*block_k .. (j+1)*block_k - 1, for j < cdiv(L + W, block_k). The
    blocks before floor(L / block_k) are wholly in the prefix and need no mask; the others take
    the bias (`tree_bias`).

    Refs (GMEM): lens_ref [batch] int32; q_ref [batch, kv_heads, rows, head_dim];
    k_ref, v_ref [batch, max_len, kv_heads, head_dim]; bias_ref [batch, rows, columns];
    out_ref [batch, kv_heads, programs, 128, head_dim] (normalised per program);
    lse_ref [batch, kv_heads, programs, 128] f32 (log2 units; -inf where a split saw nothing).
    """
    block_k, stages = sched.block_k, sched.stages
    (q_smem, k_smem, v_smem, bias_smem, lse_smem, *tail_smem), barriers = scratch
    k_ready, v_ready, q_ready, bias_ready, k_free, v_free, turn, *tail_ready = barriers
    b = lax.axis_index("batch")
    head, program = head_and_program(sched, kv_heads, lax.axis_index("program"))
    row_block, split, split_k = _program(sched, program)
    wg = lax.axis_index("wg")
    dtype = q_smem.dtype

    prefix_len = lens_ref[b]
    n_clean = lax.div(prefix_len, jnp.int32(block_k))
    total = lax.div(prefix_len + width + block_k - 1, jnp.int32(block_k))
    lo, hi = split_range(split, split_k, total)

    row0 = row_block * ROWS_PER_BLOCK + wg * ROWS_PER_WG
    tail_row0 = sched.full_blocks * ROWS_PER_BLOCK  # the partial block's first row

    def slot_of(i):
        return lax.rem(i - lo, jnp.int32(stages))

    def await_next_k(i):
        pl.when(i + 1 < hi)(lambda: plgpu.barrier_wait(k_ready.at[slot_of(i + 1)]))

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    def turns_before():
        # Warpgroup 1 starts a turn behind warpgroup 0 and warpgroup 0 ends one turn after it,
        # so both arrive at `turn` equally often; K block `lo` is awaited here, each later one
        # inside the step before it.
        pl.when(wg == 1)(take_turn)
        pl.when(lo < hi)(lambda: plgpu.barrier_wait(k_ready.at[0]))

    def turns_after():
        pl.when(wg == 0)(take_turn)

    def _idle():
        """A warpgroup whose 64 rows are all padding (the second half of a last block that is
        half full, as at W 272 x group 4): no products, only its part in freeing the K/V slots
        and in the turns, in step with the other warpgroup, which then has the tensor cores."""
        turns_before()

        @pl.loop(lo, hi)
        def _step(i):
            slot = slot_of(i)
            take_turn()
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)
            await_next_k(i)
            plgpu.barrier_arrive(v_free.at[slot])

        turns_after()

    q_tile = q_smem.at[wg]
    bias_tile = bias_smem.at[wg]
    first_masked = jnp.maximum(lo, n_clean)
    wgmma_layout = plgpu.Layout.WGMMA

    def load_bias(step):
        cols = pl.ds((step - n_clean) * block_k, block_k)
        plgpu.copy_gmem_to_smem(bias_ref.at[b, pl.ds(row0, ROWS_PER_WG), cols], bias_tile,
                                bias_ready.at[wg])

    def next_bias(step):
        """Loads the bias of key block `step` over the tile the warpgroup has just read. One
        thread issues the copy, and nothing else holds the other warps: until all four have
        read the tile, the copy could overwrite rows a late warp has yet to read (their mask
        then comes from the next block). Seen on an H200 as 7 different outputs in 20 runs of one
        case, 0.10 off in the main rows, once the folded tail's memory warpgroup shared the SM's
        issue slots (BENCHMARKS.md). The warpgroup's barrier (in
        `commit_smem`) closes that."""
        plgpu.commit_smem()
        load_bias(step)

    def start():
        """Loads this warpgroup's q rows (and the first bias block); the softmax's initial state."""
        plgpu.copy_gmem_to_smem(q_ref.at[b, head, pl.ds(row0, ROWS_PER_WG)], q_tile, q_ready.at[wg])
        pl.when(first_masked < hi)(lambda: load_bias(first_masked))
        plgpu.barrier_wait(q_ready.at[wg])
        row_layout = wgmma_layout.reduce(1)
        m_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), _M_INIT, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), 0.0, jnp.float32), row_layout)
        acc = plgpu.layout_cast(jnp.full((ROWS_PER_WG, q_tile.shape[-1]), 0.0, jnp.float32),
                                wgmma_layout)
        return acc, m_i, l_i

    def softmax(i, s, acc, m_i, l_i, masked: bool):
        """The online softmax of key block i's scores s [64, block_k] (raw q.k): the rescaled
        acc, the new running max and sum, and P in the input dtype for P @ V. The scores are
        scaled inside exp2's argument (s * scale - max, one fused multiply-add), so the row max
        is taken of the raw scores and scaled once."""
        if masked:  # the bias is 0 / -inf, the same scaled or not
            plgpu.barrier_wait(bias_ready.at[wg])
            s = s + bias_tile[...].astype(jnp.float32)
            pl.when(i + 1 < hi)(functools.partial(next_bias, i + 1))
        m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
        alpha = jnp.exp2(m_i - m_new)
        m_cols = lax.broadcast_in_dim(m_new, s.shape, [0])
        p = jnp.exp2(s * qk_scale - m_cols)
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        return acc, m_new, l_i, p.astype(dtype)

    def finish(acc, m_i, l_i):
        """Normalises the rows and writes them with their log-sum-exp."""
        seen = l_i > 0
        inv = 1.0 / jnp.where(seen, l_i, 1.0)
        q_tile[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        out_rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)
        plgpu.copy_smem_to_gmem(q_tile, out_ref.at[b, head, program, out_rows])
        plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, head, program, out_rows])
        plgpu.wait_smem_to_gmem(0)

    def _work():
        """The warpgroup's 64 rows of q against its split of the key blocks."""
        carry = start()

        def step(i, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = slot_of(i)

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_tile, _transposed(k_smem.at[slot]))
                take_turn()  # the other warpgroup's P @ V goes next, while this one waits
                return acc_ref[...]

            s = pl.run_scoped(scores, plgpu.ACC((ROWS_PER_WG, block_k), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            acc, m_new, l_i, p16 = softmax(i, s, acc, m_i, l_i, masked)
            # Meant to keep the softmax before the handover; the compiled kernel still arrives
            # right after the row max, so the two warpgroups' softmaxes overlap. Tying the
            # arrive to the row sums made the kernel alone faster (35.9 against 39.4 us at
            # W 257, ctx 4K) but the decoding round no faster (BENCHMARKS.md).
            acc, m_new, l_i, p16 = lax.optimization_barrier((acc, m_new, l_i, p16))
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                await_next_k(i)  # wait for the next K block while this product runs

            acc = pl.run_state(values)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        turns_before()
        carry = lax.fori_loop(lo, jnp.minimum(hi, n_clean), functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(first_masked, hi, functools.partial(step, masked=True), carry)
        turns_after()
        finish(*carry)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(REGISTERS[sched.fold_tail][0], action="increase")
        idle = row0 >= sched.real_rows
        pl.when(idle)(_idle)
        pl.when(jnp.logical_not(idle))(_work)

    def _tail_of_block(i, slot, carry):
        """Folded tail (`Schedule.fold_tail`), by the memory warpgroup: the partial block's
        TAIL_COLS rows against key block i in `slot`, keys on wgmma's M side. Frees the K slot
        once S^T = K Q^T is read, then takes the V block; returns the softmax state."""
        qt_smem, bt_smem, pt_smem, _ = tail_smem
        ot, m_t, l_t = carry

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, k_smem.at[slot], _transposed(qt_smem))
            return acc_ref[...]

        st = pl.run_scoped(scores, plgpu.ACC((block_k, TAIL_COLS), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        plgpu.barrier_wait(v_ready.at[slot])

        def add_bias(st):
            cols = pl.ds((i - n_clean) * block_k, block_k)
            plgpu.copy_gmem_to_smem(bias_ref.at[b, pl.ds(tail_row0, TAIL_COLS), cols], bt_smem, tail_ready[0])
            plgpu.barrier_wait(tail_ready[0])
            bias = plgpu.layout_cast(_transposed(bt_smem)[...], plgpu.Layout.WGMMA_TRANSPOSED)
            return st + plgpu.layout_cast(bias, wgmma_layout).astype(jnp.float32)

        st = lax.cond(i >= n_clean, add_bias, lambda st: st, st)
        m_new = jnp.maximum(m_t, st.max(axis=0) * qk_scale)
        alpha = jnp.exp2(m_t - m_new)
        p = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(m_new, st.shape, [1]))
        l_t = l_t * alpha + p.sum(axis=0)
        ot = ot * lax.broadcast_in_dim(alpha, ot.shape, [1])
        _transposed(pt_smem)[...] = plgpu.layout_cast(p.astype(dtype), plgpu.Layout.WGMMA_TRANSPOSED)
        plgpu.commit_smem()

        def values(acc_ref):
            plgpu.wgmma(acc_ref, _transposed(v_smem.at[slot]), _transposed(pt_smem))

        return pl.run_state(values)(plgpu.ACC.init(ot)), m_new, l_t

    def refill(i):
        """The memory warpgroup loads key block i into its slot once the block before it there
        (i - stages) is freed."""
        slot, keys = slot_of(i), pl.ds(i * block_k, block_k)
        plgpu.barrier_wait(k_free.at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[b, keys, head], k_smem.at[slot], k_ready.at[slot])
        plgpu.barrier_wait(v_free.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[b, keys, head], v_smem.at[slot], v_ready.at[slot])

    def _fold_tail():
        """The memory warpgroup with a folded tail: each K/V block is awaited here as well, and
        the blocks of this program's row block (i % full_blocks) go through `_tail_of_block`
        before their slots are freed and refilled; then the tail partial is written."""
        qt_smem, _, _, lse_t_smem = tail_smem
        plgpu.copy_gmem_to_smem(q_ref.at[b, head, pl.ds(tail_row0, TAIL_COLS)], qt_smem, tail_ready[0])
        plgpu.barrier_wait(tail_ready[0])
        col_layout = wgmma_layout.reduce(0)
        carry = (plgpu.layout_cast(jnp.full((qt_smem.shape[-1], TAIL_COLS), 0.0, jnp.float32), wgmma_layout),
                 plgpu.layout_cast(jnp.full((TAIL_COLS,), _M_INIT, jnp.float32), col_layout),
                 plgpu.layout_cast(jnp.full((TAIL_COLS,), 0.0, jnp.float32), col_layout))

        def skip(slot, carry):
            plgpu.barrier_arrive(k_free.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            return carry

        def block(i, carry):
            slot = slot_of(i)
            plgpu.barrier_wait(k_ready.at[slot])
            carry = lax.cond(takes_tail_block(i, row_block, sched.full_blocks),
                             functools.partial(_tail_of_block, i, slot), functools.partial(skip, slot), carry)
            plgpu.barrier_arrive(v_free.at[slot])
            pl.when(i + stages < hi)(functools.partial(refill, i + stages))
            return carry

        ot, m_t, l_t = lax.fori_loop(lo, hi, block, carry)
        seen = l_t > 0
        inv = 1.0 / jnp.where(seen, l_t, 1.0)
        out_t = (ot * lax.broadcast_in_dim(inv, ot.shape, [1])).astype(dtype)
        _transposed(qt_smem)[...] = plgpu.layout_cast(out_t, plgpu.Layout.WGMMA_TRANSPOSED)
        lse_t_smem[...] = jnp.where(seen, m_t + jnp.log2(jnp.where(seen, l_t, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        tail_program = sched.main_programs + program
        plgpu.copy_smem_to_gmem(qt_smem, out_ref.at[b, head, tail_program, pl.ds(0, TAIL_COLS)])
        plgpu.copy_smem_to_gmem(lse_t_smem, lse_ref.at[b, head, tail_program, pl.ds(0, TAIL_COLS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(REGISTERS[sched.fold_tail][1], action="decrease")

        def issue(i, slot):
            keys = pl.ds(i * block_k, block_k)
            plgpu.copy_gmem_to_smem(k_ref.at[b, keys, head], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, keys, head], v_smem.at[slot], v_ready.at[slot])

        for j in range(stages):
            pl.when(lo + j < hi)(functools.partial(issue, lo + j, j))
        if sched.fold_tail:
            _fold_tail()
            return

        pl.loop(lo + stages, hi)(refill)


# A jit of its own: a model calls the kernel once per layer, and JAX lowers a jitted function
# once per program, not once per call. Lowering 36 calls for cuda took 20.8 s and 13 MB of HLO
# text inline, 0.8 s and 0.4 MB nested (on a CPU).
@functools.partial(jax.jit, static_argnames=("width", "scale", "sched"))
def hopper_partials(q_rows: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                    bias: jax.Array, *, width: int, scale: float, sched: Schedule
                    ) -> tuple[jax.Array, jax.Array]:
    """Runs the kernel.

    Args:
      q_rows: [batch, kv_heads, sched.padded_rows, head_dim] bf16/f16; row r of a kv head is
        token r // group, q head kv_head * group + r % group.
      k, v: [batch, max_len, kv_heads, head_dim] the layer's cache, tree K/V at L..L+W-1.
      prefix_lens: [batch] int32.
      bias: [batch, sched.padded_rows, bias_columns(width, block_k)] from `tree_bias`.
    Returns:
      (out [batch, kv_heads, programs, 128, head_dim] normalised per program,
       lse [batch, kv_heads, programs, 128] f32 in log2 units), for `merge`.
    """
    if plgpu is None:
        raise RuntimeError("tree attention on Hopper needs jax's Mosaic GPU backend")
    batch, kv_heads, rows, head_dim = q_rows.shape
    bk, stages = sched.block_k, sched.stages
    if rows != sched.padded_rows or head_dim % 64 or bk % 64 or k.shape[1] % 8:
        raise ValueError(f"hopper_partials: rows={rows} must be {sched.padded_rows}, head_dim={head_dim} "
                         f"and block_k={bk} multiples of 64, max_len={k.shape[1]} a multiple of 8")
    columns = bias_columns(width, bk)
    if bias.shape != (batch, rows, columns):
        raise ValueError(f"hopper_partials: bias {bias.shape} != {(batch, rows, columns)}")
    dtype = q_rows.dtype
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(lens_ref, q_ref, k_ref, v_ref, bias_ref, out_ref, lse_ref):
        smem = (
            plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((stages, bk, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((stages, bk, head_dim), dtype, transforms=swizzled),
            plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG, bk), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((COMPUTE_WGS, ROWS_PER_WG), jnp.float32),
        )
        if sched.fold_tail:  # the tail's q (then its output), bias and P^T; its log-sum-exp
            smem += (plgpu.SMEM((TAIL_COLS, head_dim), dtype, transforms=swizzled),
                     plgpu.SMEM((TAIL_COLS, bk), jnp.bfloat16, transforms=swizzled),
                     plgpu.SMEM((TAIL_COLS, bk), dtype, transforms=swizzled),
                     plgpu.SMEM((TAIL_COLS,), jnp.float32))
        freers = COMPUTE_WGS + sched.fold_tail  # with a folded tail the memory warpgroup frees too
        barriers = (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
            plgpu.Barrier(num_arrivals=freers, num_barriers=stages),
            plgpu.Barrier(num_arrivals=freers, num_barriers=stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # turns on the tensor cores
        ) + ((plgpu.Barrier(num_barriers=1),) if sched.fold_tail else ())
        pl.run_scoped(
            lambda *scratch: _kernel(lens_ref, q_ref, k_ref, v_ref, bias_ref, out_ref, lse_ref,
                                     scratch, sched=sched, width=width, kv_heads=kv_heads,
                                     qk_scale=float(scale) * _LOG2E),
            smem, barriers, collective_axes="wg")

    programs = sched.programs
    out_type = (jax.ShapeDtypeStruct((batch, kv_heads, programs, ROWS_PER_BLOCK, head_dim), dtype),
                jax.ShapeDtypeStruct((batch, kv_heads, programs, ROWS_PER_BLOCK), jnp.float32))
    call = plgpu.kernel(
        entry,
        out_type=out_type,
        grid=(kv_heads * sched.launched, batch),
        grid_names=("program", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    return call(prefix_lens.astype(jnp.int32), q_rows, k, v, bias)


def _merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """[..., splits, 128, head_dim] + lse [..., splits, 128] -> [..., 128, head_dim] in float32.

    The max and sums over the splits are unrolled into elementwise ops (there are 2 or 16) rather
    than reductions: XLA does not fuse a reduction into its consumer, and the merge is then one or
    two fusions with the move to tokens instead of four kernels (8.8 us a layer at W 272).
    """
    parts = [lse[..., s, :] for s in range(lse.shape[-2])]
    top = functools.reduce(jnp.maximum, parts)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = [jnp.exp2(part - top) for part in parts]  # 0 for a split that saw nothing
    total = functools.reduce(jnp.add, weights)
    inv = 1.0 / jnp.where(total > 0, total, 1.0)
    terms = [(w * inv)[..., None] * out[..., s, :, :].astype(jnp.float32) for s, w in enumerate(weights)]
    return functools.reduce(jnp.add, terms)


def merge(out: jax.Array, lse: jax.Array, sched: Schedule) -> jax.Array:
    """The programs' partials -> [batch, kv_heads, padded_rows, head_dim] in out's dtype."""
    batch, kv_heads, _, block, head_dim = out.shape
    parts = []
    if sched.full_blocks:
        n, s = sched.full_blocks, sched.main_split
        o = out[:, :, :sched.main_programs].reshape(batch, kv_heads, n, s, block, head_dim)
        m = lse[:, :, :sched.main_programs].reshape(batch, kv_heads, n, s, block)
        parts.append(_merge_splits(o, m).reshape(batch, kv_heads, n * block, head_dim))
    if sched.tail:
        parts.append(_merge_splits(out[:, :, sched.main_programs:], lse[:, :, sched.main_programs:]))
    merged = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=2)
    return merged.astype(out.dtype)


def rows_of(q: jax.Array, kv_heads: int, padded_rows: int) -> jax.Array:
    """[batch, width, q_heads, head_dim] -> [batch, kv_heads, padded_rows, head_dim] (zero padded)."""
    batch, width, q_heads, head_dim = q.shape
    group = q_heads // kv_heads
    q5 = q.reshape(batch, width, kv_heads, group, head_dim)
    rows = jnp.transpose(q5, (0, 2, 1, 3, 4)).reshape(batch, kv_heads, width * group, head_dim)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, padded_rows - width * group), (0, 0)))


def tokens_of(out_rows: jax.Array, width: int, group: int) -> jax.Array:
    """[batch, kv_heads, padded_rows, head_dim] -> [batch, width, kv_heads * group, head_dim]."""
    batch, kv_heads, _, head_dim = out_rows.shape
    o5 = out_rows[:, :, :width * group].reshape(batch, kv_heads, width, group, head_dim)
    return jnp.transpose(o5, (0, 2, 1, 3, 4)).reshape(batch, width, kv_heads * group, head_dim)


def split_merge_reference(out: jax.Array, lse: jax.Array, sched: Schedule, *, width: int,
                          group: int) -> jax.Array:
    """`split_merge.split_merge` in jnp (its reference): the unrolled merge, then the move to
    tokens."""
    return tokens_of(merge(out, lse, sched), width, group)


def attend_rows(q_rows: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                visible: jax.Array | None, *, width: int, group: int, scale: float, sched: Schedule
                ) -> jax.Array:
    """The kernel on q given as rows, its merge, and the move back to tokens (one Triton kernel
    where it applies, else jnp).

    q_rows: [batch, kv_heads, sched.padded_rows, head_dim] (`rows_of`, or the qkv epilogue's);
    returns [batch, width, kv_heads * group, head_dim].
    """
    if q_rows.shape[1] != k.shape[2] or sched.padded_rows < width * group:
        raise ValueError(f"attend_rows: q_rows {q_rows.shape} must be [batch, kv_heads={k.shape[2]}, "
                         f"rows >= width * group = {width * group}, head_dim]")
    bias = tree_bias(visible, prefix_lens, width, group, sched.padded_rows, sched.block_k)
    out, lse = hopper_partials(q_rows, k, v, prefix_lens, bias, width=width, scale=scale, sched=sched)
    if split_merge.applies(group, out.shape[-1], ROWS_PER_BLOCK):
        return split_merge.split_merge(out, lse, sched, width=width, group=group)
    return split_merge_reference(out, lse, sched, width=width, group=group)


def tree_attention_hopper(q: jax.Array, k: jax.Array, v: jax.Array, prefix_lens: jax.Array,
                          visible: jax.Array | None, *, scale: float, num_sms: int = 132,
                          sched: Schedule | None = None) -> jax.Array:
    """Tree attention (the contract of `tree_attention.tree_attention_reference`) in one launch.

    q: [batch, width, q_heads, head_dim]; returns the same shape. See the module docstring for
    what the caller must guarantee.
    """
    batch, width, q_heads, head_dim = q.shape
    max_len, kv_heads = k.shape[1], k.shape[2]
    group = q_heads // kv_heads
    sched = sched or schedule(batch, kv_heads, width * group, max_len, num_sms)
    return attend_rows(rows_of(q, kv_heads, sched.padded_rows), k, v, prefix_lens, visible, width=width,
                       group=group, scale=scale, sched=sched)
