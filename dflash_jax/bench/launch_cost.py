"""What a kernel launch costs, by kind of kernel: an XLA fusion, a Pallas Triton kernel, a Pallas
Mosaic GPU kernel (with and without programmatic dependent launch).

With the verify's gated activation in a Mosaic GPU kernel (36 Mosaic launches a DDTree(256)
round more, 72 cuBLAS and XLA launches fewer) the round's kernels took no longer but its rounds
did, by 0.17-0.32 ms (BENCHMARKS.md, twenty-fourth session). This times chains of `--chain`
dependent kernels of one kind in one jitted program, each kernel's work far smaller than a
launch, so the time per kernel is what issuing one costs:

* `wall us`: the call's wall time per kernel (median after warm-up);
* `issue us`: the time until the call returns, before its result is waited for, per kernel
  (what the host spends issuing, where the runtime enqueues on the calling thread);
* `kernel us`: the GPU's time inside the kernels, per kernel, from a profiler trace;
* `gap us`: the GPU's idle time between consecutive kernels of the chain, per kernel;
* `loop wall us`: the same kernels as `--loop-iters` iterations of a while loop (its trip count
  a traced value, as the decoding loop's is), per kernel: the loop's own cost per iteration
  shows as the difference from `wall us`;
* `issue behind a GEMM us`: the time until the call returns when the chain waits on a long
  matrix product first (`lead ms` of GPU time, timed beside it). Launches that the host can
  queue behind running work return long before the product ends; a launch that waits for the
  GPU to reach it holds the call until the product is done.

    python -m dflash_jax.bench.launch_cost --chain 240 --out launch_cost.json
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from dflash_jax.bench.common import environment, log, time_fn, write_json
from dflash_jax.bench.profile import kernel_events

KINDS = ("xla", "triton", "mosaic", "mosaic-pdl")


def _xla_step(x: jax.Array) -> jax.Array:
    # The barrier keeps XLA from fusing the chain into one kernel.
    return lax.optimization_barrier(jnp.tanh(x) * 0.5 + 0.25)


def _triton_step(x: jax.Array) -> jax.Array:
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, o_ref):
        o_ref[...] = jnp.tanh(x_ref[...]) * 0.5 + 0.25

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1))(x)


def _mosaic_step(pdl: bool) -> Callable[[jax.Array], jax.Array]:
    """The gated-activation kernel at its smallest (one program, one K step): x [8, 64] -> [8, 64]."""
    from pallas_kernels.gate_up_silu import Tiles, gate_up_silu_kernel
    w = jax.random.normal(jax.random.key(1), (2, 64, 64), jnp.bfloat16) * 0.1
    tiles = Tiles(tokens=8, stages=1, pdl=pdl)
    return lambda x: gate_up_silu_kernel(x, w, tiles=tiles)


def step_and_input(kind: str) -> tuple[Callable[[jax.Array], jax.Array], jax.Array]:
    if kind == "xla":
        return _xla_step, jnp.ones((8, 128), jnp.float32)
    if kind == "triton":
        return _triton_step, jnp.ones((8, 128), jnp.float32)
    return _mosaic_step(kind == "mosaic-pdl"), jnp.ones((8, 64), jnp.bfloat16)


def chain(step: Callable, n: int) -> Callable:
    def run(x):
        for _ in range(n):
            x = step(x)
        return x
    return jax.jit(run)


def looped(step: Callable, per_iter: int) -> Callable:
    def run(x, iters):
        return lax.fori_loop(0, iters, lambda i, x: chain_body(x), x)

    def chain_body(x):
        for _ in range(per_iter):
            x = step(x)
        return x
    return jax.jit(run)


def behind_lead(step: Callable, n: int, size: int = 8192) -> tuple[Callable, jax.Array, Callable]:
    """The chain after a [size, size] x [size, size] bf16 product that it depends on, and the
    product alone."""
    def lead(a):
        return jnp.dot(a, a, preferred_element_type=jnp.float32)

    def run(x, a):
        m = lead(a)
        x = x + (m[: x.shape[0], : x.shape[1]] * 0).astype(x.dtype)
        for _ in range(n):
            x = step(x)
        return x
    a = jax.random.normal(jax.random.key(2), (size, size), jnp.bfloat16)
    return jax.jit(run), a, jax.jit(lead)


def issue_us(fn: Callable[[], Any], iters: int = 10) -> float:
    """Median time until `fn()` returns, before waiting for its result."""
    times = []
    for _ in range(iters):
        jax.block_until_ready(fn())  # nothing else in flight
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e6)
        jax.block_until_ready(out)
    return statistics.median(times)


def measure(kind: str, n: int, loop_iters: int, lead_size: int = 8192) -> dict[str, Any]:
    step, x = step_and_input(kind)
    fn = chain(step, n)
    wall = time_fn(lambda: fn(x), warmup=3, iters=20)["median_ms"] * 1e3
    issue = issue_us(lambda: fn(x))
    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace, create_perfetto_trace=True):
        jax.block_until_ready(fn(x))
    events = sorted(kernel_events(trace), key=lambda e: float(e["ts"]))
    busy = sum(float(e.get("dur", 0.0)) for e in events)
    span = (float(events[-1]["ts"]) + float(events[-1].get("dur", 0.0)) - float(events[0]["ts"])) if events else 0.0
    per_iter = n // loop_iters
    loop = looped(step, per_iter)
    iters = jnp.int32(loop_iters)
    loop_wall = time_fn(lambda: loop(x, iters), warmup=3, iters=20)["median_ms"] * 1e3
    behind, a, lead = behind_lead(step, n, lead_size)
    lead_ms = time_fn(lambda: lead(a), warmup=3, iters=10)["median_ms"]
    return {"kind": kind, "chain": n, "kernels_seen": len(events), "wall_us": round(wall / n, 2),
            "issue_us": round(issue / n, 2), "kernel_us": round(busy / max(len(events), 1), 2),
            "gap_us": round((span - busy) / max(len(events) - 1, 1), 2),
            "loop_iters": loop_iters, "loop_wall_us": round(loop_wall / (per_iter * loop_iters), 2),
            "lead_ms": round(lead_ms, 3), "issue_behind_lead_us": round(issue_us(lambda: behind(x, a)), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", type=int, default=240, help="dependent kernels in one program")
    ap.add_argument("--loop-iters", type=int, default=8, help="while-loop iterations sharing the chain's kernels")
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for kind in args.kinds:
        try:
            rows.append(measure(kind, args.chain, args.loop_iters))
        except Exception as e:  # one kind failing (no Mosaic GPU on this build) leaves the others
            rows.append({"kind": kind, "error": f"{type(e).__name__}: {e}"[:400]})
        log(rows[-1])
    print("| kind | kernels | wall us | issue us | kernel us | gap us | in a while loop: wall us | lead ms | "
          "issue behind the lead us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | error: {r['error'][:80]} | | | | | | | |")
        else:
            print(f"| {r['kind']} | {r['kernels_seen']} | {r['wall_us']} | {r['issue_us']} | {r['kernel_us']} | "
                  f"{r['gap_us']} | {r['loop_wall_us']} | {r['lead_ms']} | {r['issue_behind_lead_us']} |")
    if args.out:
        write_json(args.out, {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
