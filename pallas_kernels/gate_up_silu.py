"""The MLP's gated activation on Hopper (sm_90): silu(x @ gate) * (x @ up) in one Pallas Mosaic
GPU kernel.

At the rows of a 256-node tree (W 257) XLA runs this as a cuBLAS GEMM into [rows, 2, mlp], a
cuBLAS Memset before it, and a fusion for the activation after it: three launches, each after
an idle gap of about 1.7-1.9 us (cuBLAS kernels are not launched as programmatic dependents),
and the [rows, 2 x 12288] product written and read back once. This kernel writes only the
activation, [rows, mlp].

Orientation. The rows are few (257) and the weights many, so the weights take wgmma's M side
(64 per warpgroup, no padding) and the rows its N side (a multiple of 8: 257 rows cost 272, not
the 320 of 64-row blocks). Both operands are then K-major in shared memory: the weights stored
[out, in] (`[2, mlp, embed]`) and x as it is ([rows, embed]), its tile viewed transposed. The
product comes out [cols, rows] and is stored transposed into the [rows, cols] tile that TMA
writes.

Block (one program): 64 output columns x `tokens` rows.
* warpgroup 0 computes the gate's 64 columns, warpgroup 1 the up projection's same 64 columns,
  both from the same x tile; warpgroup 1 hands its product (rounded to the input dtype, as
  XLA's product is) to warpgroup 0 through shared memory, which applies silu(g) * u and stores
  the tile;
* warpgroup 2 streams x and weight tiles (K blocks of `block_k`) into a ring of `stages` slots
  with TMA; a slot is freed once both compute warpgroups' products that read it are done.

Grid: one program per (column block, row tile), row tiles fastest, so the programs that read
the same weights run side by side and the second finds them in L2 (or, with `Tiles.pair`, in
clusters of two that load them once). At 257 rows and mlp 12288:
192 column blocks x 2 row tiles of 136 = 384 programs, 2.9 waves on 132 SMs (cuBLAS's own
tiling of the product, 128 x 136, makes the same count).

With `Tiles.pingpong` (what the model's verify takes) the two compute warpgroups take whole jobs
in turn instead: each computes a job's gate and up products in two accumulators and stores its
activation while the other's products run, so the epilogue no longer holds up the tensor cores;
they pass one output tile between them, which leaves shared memory for 6 stages.

Measured (BENCHMARKS.md, twenty-third and twenty-fourth sessions; H200, 257 rows, Qwen3-8B
shape): correct (every GPU parity case), and now as fast as what it replaces, not faster. Both
warpgroups on one job: 88-96 us a product in every variant (pairs, persistent programs, PDL, 4
or 5 stages) against 82.7 us for XLA's three kernels; the DDTree(256) round 11.11 against 10.93
ms. Pingpong: 83.6 us alone at 5 stages, **80.8 at 6** against 82.2 for XLA's cuBLAS GEMM + SiLU
fusion + Memset in the same command; in the round 84.9 us a layer against cuBLAS's 76.7 plus
the fusion and the Memset, and DDTree(256) 10.64 against 10.60 ms (10.58 against 10.56 at 32
rounds a call). The main loop (m64n136 products, 64-wide K steps) is what still trails
cuBLAS's. Nothing uses it by default: only params put in `model.kernel_mlp_layout` take it
(`spec_round --mlp kernel`).

Needs: bf16/f16, embed a multiple of block_k, mlp a multiple of 64. This file holds, side by
side: the tile settings, the reference (`gate_up_silu_reference`), the kernel, its launch, and
`gate_up_silu`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# The same need (an sm_90 GPU) and the same transposed view of a shared-memory tile.
from pallas_kernels.tree_attention_hopper import _transposed, available

try:  # Mosaic GPU ships with jaxlib; absent on some builds.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the jaxlib build
    plgpu = None

COLS = 64  # output columns per program: wgmma's M for one warpgroup
MAX_TOKENS = 136  # rows per tile at most: 257 rows -> 2 tiles of 136
_SMEM_BYTES = 227 * 1024  # an sm_90 block's shared memory


@dataclasses.dataclass(frozen=True)
class Tiles:
    """tokens: rows per tile (a multiple of 8, at most 256); block_k: the K step (a multiple
    of 64); stages: K steps in flight; pdl: the kernel starts with `griddepcontrol.wait`, so
    jax launches it as a programmatic dependent of the kernel before it (its launch and set-up
    overlap that kernel's end); pair: programs run in clusters of two SMs, the two row tiles
    of one column block, which share their weight tiles: each SM loads half of every weight
    tile and TMA multicasts it to both (the weights' share of L2 reads halves), and a slot is
    freed only once the compute warpgroups of both SMs are done with it. Needs an even number
    of row tiles. programs: 0 for one program per job (a 64-column block of one row tile);
    else at most this many programs (one per SM: 132 on an H200), each taking jobs in turn,
    the next job's loads overlapping this one's activation and store.
    pingpong: the two compute warpgroups take whole jobs in turn (each computes a job's gate
    and up products, in two accumulators), so that one warpgroup's activation and store run
    while the other's products keep the tensor cores busy; with programs 0, one program per
    two jobs; the warpgroups take turns on one output tile, which leaves shared memory for 6
    stages at 136 rows. Not with pair."""
    tokens: int
    block_k: int = 64
    stages: int = 5
    pdl: bool = False
    pair: bool = False
    programs: int = 0
    pingpong: bool = False

    def smem_bytes(self, itemsize: int = 2) -> int:
        ring = self.stages * (self.tokens + 2 * COLS) * self.block_k
        tiles = 1 if self.pingpong else 2  # pingpong: one output tile, passed between the warpgroups
        return (ring + tiles * COLS * self.tokens) * itemsize


def token_tiles(rows: int) -> Tiles:
    """Rows split into the fewest tiles of at most MAX_TOKENS, each a multiple of 8."""
    n = pl.cdiv(rows, MAX_TOKENS)
    return Tiles(tokens=pl.cdiv(pl.cdiv(rows, n), 8) * 8)


def decode_tiles(rows: int) -> Tiles:
    """The tiles the model's verify uses at `rows` (a multiple of 8): `token_tiles`, the two
    compute warpgroups taking jobs in turn (`Tiles.pingpong`) over 6 stages, one program per SM,
    launched as a programmatic dependent (`Tiles.pdl`)."""
    return dataclasses.replace(token_tiles(rows), pingpong=True, programs=sm_count(), pdl=True, stages=6)


def sm_count() -> int:
    """Streaming multiprocessors of the local GPU (132 on an H200; 132 where none is seen)."""
    devices = jax.local_devices()
    return int(getattr(devices[0], "core_count", 0) or 132) if devices and devices[0].platform == "gpu" else 132


def applies(rows: int, w: jax.Array) -> bool:
    """Whether the model's verify takes the kernel for `rows` tokens and weights w [2, mlp,
    embed]: a Hopper GPU, bf16/f16, whole 64-column blocks and K steps, and rows (padded to a
    multiple of 8) that fill at least two row tiles (one tile of 136 is 192 programs, 1.5 waves)."""
    return (w.ndim == 3 and w.shape[0] == 2 and jnp.dtype(w.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and w.shape[1] % COLS == 0 and w.shape[2] % 64 == 0 and pl.cdiv(rows, 8) * 8 > MAX_TOKENS
            and available())


def gate_up_silu_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """What XLA computes for the same step: x [rows, embed], w [2, mlp, embed] (gate, up as
    [out, in]) -> silu(x @ gate.T) * (x @ up.T) [rows, mlp] in x's dtype, the products rounded
    to x's dtype first (as the model's `mlp_activation` does)."""
    from dflash_jax.model import gated_activation

    return gated_activation(jnp.einsum("se,tme->stm", x, w, preferred_element_type=x.dtype), x.dtype)


def _program_jobs(tiles: Tiles, row_tiles: int, k_steps: int, ctas: int, jobs: int):
    """This program's job count, its ring steps (k_steps a job), and `origin(n)`: the first row
    and column of its n-th job (see `_kernel` for how jobs are numbered)."""
    p = lax.axis_index("program")
    my_jobs = lax.div(jnp.int32(jobs) - p + jnp.int32(ctas - 1), jnp.int32(ctas))

    def origin(n):
        q = p + n * ctas
        if tiles.pair:
            half = jnp.int32(row_tiles // 2)
            return (lax.rem(q, half) * 2 + lax.axis_index("pair")) * tiles.tokens, lax.div(q, half) * COLS
        return lax.rem(q, jnp.int32(row_tiles)) * tiles.tokens, lax.div(q, jnp.int32(row_tiles)) * COLS

    return my_jobs, my_jobs * k_steps, origin


def _program_start(tiles: Tiles, row_tiles: int, k_steps: int, ctas: int, jobs: int):
    """What both kernels begin with: with `Tiles.pdl`, the wait for the kernel before (everything
    after it reads what earlier kernels wrote); then this program's jobs (`_program_jobs`: how
    many, its ring steps, a job's origin) and its warpgroup."""
    if tiles.pdl:
        plgpu.griddepcontrol_wait()
    my_jobs, total, origin = _program_jobs(tiles, row_tiles, k_steps, ctas, jobs)
    return my_jobs, total, origin, lax.axis_index("wg")


def _stream(x_ref, w_ref, x_smem, w_smem, barrier, *, tiles: Tiles, k_steps: int, total, origin) -> None:
    """The memory warpgroup: ring steps 0..total-1 in order, step g's x and weight tiles (K block
    g % k_steps of job g // k_steps) into slot g % stages once the step `stages` before has
    freed it. barrier(kind, g): the barrier of step g's slot for kind "x", "w" or "free"."""
    plgpu.set_max_registers(40, action="decrease")
    stages, bk, tokens = tiles.stages, tiles.block_k, tiles.tokens

    def produce(g, carry):
        t0, c0 = origin(lax.div(g, jnp.int32(k_steps)))
        ks = pl.ds(lax.rem(g, jnp.int32(k_steps)) * bk, bk)
        slot = lax.rem(g, jnp.int32(stages))
        pl.when(g >= stages)(lambda: plgpu.barrier_wait(barrier("free", g - stages)))
        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(t0, tokens), ks], x_smem.at[slot], barrier("x", g))
        w_tile = w_ref.at[:, pl.ds(c0, COLS), ks]
        if tiles.pair:
            plgpu.copy_gmem_to_smem(w_tile, w_smem.at[slot], barrier("w", g), collective_axes="pair")
        else:
            plgpu.copy_gmem_to_smem(w_tile, w_smem.at[slot], barrier("w", g))
        return carry

    lax.fori_loop(0, total, produce, None)


def _k_loop(base, *, k_steps: int, stages: int, total, barrier, issue, products: int) -> None:
    """A compute warpgroup's K loop over one job: ring steps base .. base + k_steps - 1, each
    waiting for its x and weight tiles (barrier(kind, g), as `_stream` takes it), issuing
    `products` wgmma products on its slot (issue(slot)), and freeing the step before's slot
    once only this step's products are in flight, where a later load (of the program's `total`
    ring steps) needs it: with `pair` the other SM may have exited by the time the last ones
    would be freed."""
    def release(g):
        pl.when(g + stages < total)(lambda: plgpu.barrier_arrive(barrier("free", g)))

    def step(i, carry):
        g = base + i
        slot = lax.rem(g, jnp.int32(stages))
        plgpu.barrier_wait(barrier("x", g))
        plgpu.barrier_wait(barrier("w", g))
        issue(slot)
        plgpu.wgmma_wait(products)
        pl.when(i > 0)(lambda: release(g - 1))
        return carry

    lax.fori_loop(0, k_steps, step, None)
    plgpu.wgmma_wait(0)
    release(base + k_steps - 1)


def _activation(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in `dtype`, from products rounded to `dtype` first as XLA's product is."""
    gate = gate.astype(dtype).astype(jnp.float32)
    return (gate / (1.0 + jnp.exp(-gate)) * up.astype(dtype).astype(jnp.float32)).astype(dtype)


def _store(h: jax.Array, out_smem, out_ref, t0, c0) -> None:
    """h [COLS, tokens] (WGMMA layout) into out_ref's tile at rows t0, columns c0, through
    out_smem [tokens, COLS] held [rows, cols] (rows a multiple of 8, not of 64, so it cannot be
    tiled the other way round) and written through a transposed view. The caller sees to it
    that the last store from out_smem has read it."""
    _transposed(out_smem)[...] = plgpu.layout_cast(h, plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[pl.ds(t0, out_smem.shape[0]), pl.ds(c0, COLS)])


def _kernel(x_ref, w_ref, out_ref, scratch, *, tiles: Tiles, row_tiles: int, k_steps: int, ctas: int,
            jobs: int):
    """One program: its jobs, each 64 columns of the activation for one tile of rows.

    A job q is column block q // row_tiles, row tile q % row_tiles (with `pair`, a cluster's
    job q: column block q // (row_tiles / 2), row tiles 2 (q % (row_tiles / 2)) + 0 and + 1).
    Program p (cluster p) takes jobs p, p + ctas, p + 2 ctas, ...; the ring of slots runs on
    across them, so the next job's first loads land while this one's activation is stored.
    Refs (GMEM): x_ref [rows, embed]; w_ref [2, mlp, embed]; out_ref [rows, mlp].
    """
    (x_smem, w_smem, up_smem, out_smem), (x_ready, w_ready, free, up_ready, up_free) = scratch
    stages, tokens, dtype = tiles.stages, tiles.tokens, x_smem.dtype
    my_jobs, total, origin, wg = _program_start(tiles, row_tiles, k_steps, ctas, jobs)

    bars = {"x": x_ready, "w": w_ready, "free": free}

    def barrier(kind, g):
        """The barrier of ring step g's slot."""
        return bars[kind].at[lax.rem(g, jnp.int32(stages))]

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        def job(n, carry):
            t0, c0 = origin(n)

            def products(acc_ref):
                _k_loop(n * k_steps, k_steps=k_steps, stages=stages, total=total, barrier=barrier, products=1,
                        issue=lambda slot: plgpu.wgmma(acc_ref, w_smem.at[slot, wg], _transposed(x_smem.at[slot])))
                return acc_ref[...]

            acc = pl.run_scoped(products, plgpu.ACC((COLS, tokens), jnp.float32))
            # Rounded as XLA's product is, before the activation.
            product = acc.astype(dtype)

            # Held [rows, cols] as the output tile is (`_store`).
            @pl.when(wg == 1)
            def _hand_over():
                pl.when(n > 0)(lambda: plgpu.barrier_wait(up_free))  # the last job's is read
                _transposed(up_smem)[...] = plgpu.layout_cast(product, plgpu.Layout.WGMMA_TRANSPOSED)
                plgpu.barrier_arrive(up_ready)

            @pl.when(wg == 0)
            def _activate():
                plgpu.barrier_wait(up_ready)
                up = plgpu.load(_transposed(up_smem), (), layout=plgpu.Layout.WGMMA_TRANSPOSED)
                up = plgpu.layout_cast(up, plgpu.Layout.WGMMA)
                pl.when(n + 1 < my_jobs)(lambda: plgpu.barrier_arrive(up_free))
                h = _activation(product, up, dtype)
                # The last job's store has read the tile before it is written again.
                pl.when(n > 0)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
                _store(h, out_smem, out_ref, t0, c0)

            return carry

        lax.fori_loop(0, my_jobs, job, None)
        pl.when(wg == 0)(lambda: plgpu.wait_smem_to_gmem(0))

    pl.when(wg == 2)(lambda: _stream(x_ref, w_ref, x_smem, w_smem, barrier, tiles=tiles, k_steps=k_steps,
                                     total=total, origin=origin))


def _pingpong_kernel(x_ref, w_ref, out_ref, scratch, *, tiles: Tiles, row_tiles: int, k_steps: int, ctas: int,
                     jobs: int):
    """One program with `Tiles.pingpong`: its jobs (as `_kernel` numbers them) taken in turn by
    the two compute warpgroups, job n by warpgroup n % 2, each computing the gate's and the up
    projection's 64 columns in two accumulators and storing the activation itself.

    The memory warpgroup streams the jobs' K steps in job order through one ring of `stages`
    slots, so a warpgroup's next job can only start as the other's products drain the ring:
    the two take turns on the tensor cores, and each one's activation and store overlap the
    other's products. Every slot has one set of barriers per warpgroup (index wg * stages +
    slot): a barrier's phase is tracked by each thread that waits on it, so each must be waited
    on by one warpgroup at every one of its phases. The output tile is passed in job order: job
    n's warpgroup writes it once job n - 1's store has read it (`out_free`, one barrier per
    warpgroup, arrived at by the other).
    Refs (GMEM): x_ref [rows, embed]; w_ref [2, mlp, embed]; out_ref [rows, mlp].
    """
    (x_smem, w_smem, out_smem), (x_ready, w_ready, free, out_free) = scratch
    stages, tokens, dtype = tiles.stages, tiles.tokens, x_smem.dtype
    my_jobs, total, origin, wg = _program_start(tiles, row_tiles, k_steps, ctas, jobs)

    bars = {"x": x_ready, "w": w_ready, "free": free}

    def barrier(kind, g):
        """The barrier of ring step g's slot that belongs to the warpgroup of g's job."""
        owner = lax.rem(lax.div(g, jnp.int32(k_steps)), 2)
        return bars[kind].at[owner * stages + lax.rem(g, jnp.int32(stages))]

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")

        def job(j, carry):
            n = wg + 2 * j
            t0, c0 = origin(n)

            def products(gate_ref, up_ref):
                def issue(slot):
                    x_t = _transposed(x_smem.at[slot])
                    plgpu.wgmma(gate_ref, w_smem.at[slot, 0], x_t)
                    plgpu.wgmma(up_ref, w_smem.at[slot, 1], x_t)

                _k_loop(n * k_steps, k_steps=k_steps, stages=stages, total=total, barrier=barrier, issue=issue,
                        products=2)
                return gate_ref[...], up_ref[...]

            acc = plgpu.ACC((COLS, tokens), jnp.float32)
            gate, up = pl.run_scoped(products, acc, acc)
            h = _activation(gate, up, dtype)
            pl.when(n > 0)(lambda: plgpu.barrier_wait(out_free.at[wg]))  # job n - 1's store has read it
            _store(h, out_smem, out_ref, t0, c0)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(out_free.at[1 - wg])
            return carry

        lax.fori_loop(0, lax.div(my_jobs - wg + 1, 2), job, None)
        plgpu.wait_smem_to_gmem(0)

    pl.when(wg == 2)(lambda: _stream(x_ref, w_ref, x_smem, w_smem, barrier, tiles=tiles, k_steps=k_steps,
                                     total=total, origin=origin))


# A jit of its own: a model calls the kernel once per layer, and JAX lowers a jitted function
# once per program, not once per call.
@functools.partial(jax.jit, static_argnames=("tiles",))
def gate_up_silu_kernel(x: jax.Array, w: jax.Array, *, tiles: Tiles) -> jax.Array:
    """The kernel on x's rows as they are.

    x: [rows, embed], rows a multiple of 8 (the tiling of shared memory) and >= tiles.tokens;
    w: [2, mlp, embed]. Returns [rows, mlp] in x's dtype. Where rows are not a whole number of tiles, the last tile reads zeros past the end
    of x and its rows past the end of the output are not written (TMA's bounds handling).
    """
    if plgpu is None:
        raise RuntimeError("gate_up_silu needs jax's Mosaic GPU backend")
    rows, embed = x.shape
    bk, stages, tokens = tiles.block_k, tiles.stages, tiles.tokens
    if w.ndim != 3 or w.shape[0] != 2 or w.shape[2] != embed:
        raise ValueError(f"gate_up_silu: w {w.shape} must be [2, mlp, embed={embed}] (gate, up as [out, in])")
    mlp = w.shape[1]
    if x.dtype not in (jnp.bfloat16, jnp.float16) or w.dtype != x.dtype:
        raise ValueError(f"gate_up_silu: x {x.dtype} and w {w.dtype} must be one dtype, bf16 or f16")
    if rows < tokens or rows % 8 or tokens % 8 or tokens > 256:
        raise ValueError(f"gate_up_silu: rows={rows} must be a multiple of 8 and at least tiles.tokens={tokens}, "
                         "itself a multiple of 8 and at most 256")
    if embed % bk or bk % 64:
        raise ValueError(f"gate_up_silu: embed={embed} must be a multiple of block_k={bk} (a multiple of 64)")
    if mlp % COLS:
        raise ValueError(f"gate_up_silu: w's mlp={mlp} must be a multiple of {COLS}")
    if tiles.smem_bytes(x.dtype.itemsize) > _SMEM_BYTES:
        raise ValueError(f"gate_up_silu: {tiles} needs {tiles.smem_bytes(x.dtype.itemsize)} bytes of shared "
                         f"memory, more than {_SMEM_BYTES}")
    row_tiles = pl.cdiv(rows, tokens)
    if tiles.pair and row_tiles % 2:
        raise ValueError(f"gate_up_silu: pair needs an even number of row tiles, rows={rows} make {row_tiles}")
    if tiles.pair and tiles.pingpong:
        raise ValueError("gate_up_silu: tiles.pingpong does not take pair")
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    size = 2 if tiles.pair else 1
    jobs = (mlp // COLS) * row_tiles // size  # per cluster of `size`
    # With programs 0: one program per job, or per two jobs with pingpong (never with pair).
    ctas = min(jobs, tiles.programs // size) if tiles.programs else pl.cdiv(jobs, 2 if tiles.pingpong else 1)

    def pingpong_entry(x_ref, w_ref, out_ref):
        smem = (
            plgpu.SMEM((stages, tokens, bk), x.dtype, transforms=swizzled),
            plgpu.SMEM((stages, 2, COLS, bk), x.dtype, transforms=swizzled),
            plgpu.SMEM((tokens, COLS), x.dtype, transforms=swizzled),
        )
        barriers = (  # [warpgroup, slot], flattened; then the output tile's, by warpgroup
            plgpu.Barrier(num_barriers=2 * stages),
            plgpu.Barrier(num_barriers=2 * stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
        )
        pl.run_scoped(
            lambda *scratch: _pingpong_kernel(x_ref, w_ref, out_ref, scratch, tiles=tiles, row_tiles=row_tiles,
                                              k_steps=embed // bk, ctas=ctas, jobs=jobs),
            smem, barriers, collective_axes="wg")

    def entry(x_ref, w_ref, out_ref):
        smem = (
            plgpu.SMEM((stages, tokens, bk), x.dtype, transforms=swizzled),
            plgpu.SMEM((stages, 2, COLS, bk), x.dtype, transforms=swizzled),
            plgpu.SMEM((tokens, COLS), x.dtype, transforms=swizzled),
            plgpu.SMEM((tokens, COLS), x.dtype, transforms=swizzled),
        )
        barriers = (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            # Both compute warpgroups (of both SMs, with `pair`).
            (plgpu.ClusterBarrier(collective_axes=("pair",), num_arrivals=2, num_barriers=stages) if tiles.pair
             else plgpu.Barrier(num_arrivals=2, num_barriers=stages)),
            plgpu.Barrier(num_arrivals=1),  # up's product handed over
            plgpu.Barrier(num_arrivals=1),  # ... and read, so the next job's may be written
        )
        pl.run_scoped(
            lambda *scratch: _kernel(x_ref, w_ref, out_ref, scratch, tiles=tiles, row_tiles=row_tiles,
                                     k_steps=embed // bk, ctas=ctas, jobs=jobs),
            smem, barriers, collective_axes="wg")

    call = plgpu.kernel(
        pingpong_entry if tiles.pingpong else entry,
        out_type=jax.ShapeDtypeStruct((rows, mlp), x.dtype),
        grid=(ctas,),
        grid_names=("program",),
        **(dict(cluster=(2,), cluster_names=("pair",)) if tiles.pair else {}),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    return call(x, w)


def gate_up_silu(x: jax.Array, w: jax.Array, tiles: Tiles | None = None, pad: bool = False) -> jax.Array:
    """silu(x @ w[0].T) * (x @ w[1].T) for x [..., embed] and w [2, mlp, embed]: [..., mlp].

    The rows are padded with zeros to a multiple of 8 (the last tile may be partial,
    `gate_up_silu_kernel`), or with `pad` (and wherever there are fewer rows than one tile) to
    whole tiles (`token_tiles`); the padding is dropped after.
    """
    lead, embed = x.shape[:-1], x.shape[-1]
    rows = 1
    for d in lead:
        rows *= d
    tiles = tiles or token_tiles(rows)
    flat = x.reshape(rows, embed)
    whole = pl.cdiv(rows, tiles.tokens) * tiles.tokens
    padded = whole if pad or rows < tiles.tokens else pl.cdiv(rows, 8) * 8
    if padded != rows:
        flat = jnp.pad(flat, ((0, padded - rows), (0, 0)))
    out = gate_up_silu_kernel(flat, w, tiles=tiles)
    return out[:rows].reshape(*lead, w.shape[1])
