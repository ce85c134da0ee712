"""DDTree's tree on device, and its vocabulary top-k alone, over the ways to take that top-k.

At [batch * 15 depths, vocab] log-probs (the drafter's per-depth distributions of a block of 16)
and k = min(budget, vocab), for each budget:

* the vocabulary top-k alone: `lax.top_k` itself, `tree.chunked_top_k` (chunks of 2048, the
  tree's way until the eighteenth session), `tree.preselected_top_k` at each `--fanouts` value
  and `tree.radix_top_k` at each `--radix-bits` x `--radix-prechunks` value (and with its
  counts as a broadcast compare instead of one variadic reduce, `--radix-broadcast`);
* the whole tree (`tree.build_tree`) with `preselect` 0 (chunked), the default fan-out for k on
  a GPU, each `--tree-fanouts` value and radix (`preselect` -c for each `--radix-prechunks` c);
* with `--kernel`: the Triton kernels (`pallas_kernels.top_k.top_k`, two launches) at each
  `--kernel-chunks` x `--kernel-warps` value (their select kernel's warps), and the tree with
  `preselect` "kernel" (`tree.kernel_top_k`, the kernels' defaults).

Each variant runs `--calls` calls on distinct inputs in one jitted program; reported per call:
the GPU's kernel time from a profiler trace (all kernels of the call), the number of kernels
and the wall time. Every variant's indices are checked against `lax.top_k` (and every tree
against the chunked one) before it is timed.

    python -m dflash_jax.bench.top_k_bench --budgets 16 64 256 512 --out top_k.json
    python -m dflash_jax.bench.top_k_bench --budgets 16 64 256 512 --fanouts 4 --kernel
"""
from __future__ import annotations

import argparse
import functools
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.common import environment, log, time_fn, write_json
from dflash_jax.bench.profile import kernel_events
from dflash_jax.tree import (KERNEL_PRESELECT, TOP_K_CHUNK, build_tree, chunked_top_k, preselect_fanout,
                             preselected_top_k, radix_top_k, tree_width)


def log_probs(calls: int, batch: int, depth: int, vocab: int, sharpness: float) -> tuple[jax.Array, ...]:
    """`calls` distinct [batch, depth, vocab] float32 log-probs, drawn on the device."""
    keys = jax.random.split(jax.random.key(0), calls)
    draw = jax.jit(lambda k: jax.nn.log_softmax(
        sharpness * jax.random.normal(k, (batch, depth, vocab), jnp.float32), -1))
    return tuple(jax.block_until_ready(draw(k)) for k in keys)


def time_variant(step: Callable[[jax.Array], tuple], inputs: tuple[jax.Array, ...]) -> dict[str, float]:
    """Per call: GPU kernel us and kernel count of one traced run, median wall us after warm-up."""
    run = jax.jit(lambda xs: tuple(step(x) for x in xs))
    wall = time_fn(lambda: run(inputs), warmup=2, iters=10)
    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace, create_perfetto_trace=True):
        jax.block_until_ready(run(inputs))
    events = kernel_events(trace)
    calls = len(inputs)
    return {"kernel_us": sum(float(e.get("dur", 0.0)) for e in events) / calls,
            "kernels": len(events) / calls, "wall_us": wall["median_ms"] * 1e3 / calls}


def bench_budget(inputs: tuple[jax.Array, ...], budget: int, fanouts: list[int],
                 tree_extra: list[int], radix_bits: list[int], radix_prechunks: list[int],
                 radix_broadcast: bool, kernel_settings: list[tuple[int, int]] = ()) -> list[dict]:
    """Rows of the table for one budget. kernel_settings: (chunk, select warps) pairs for the
    Triton kernels (none: neither they nor the tree through them are timed)."""
    batch, depth, vocab = inputs[0].shape
    k = min(budget, vocab)
    rows_of = lambda x: x.reshape(batch * depth, vocab)
    want_val, want = jax.lax.top_k(rows_of(inputs[0]), k)
    top_k = {"lax.top_k": lambda x: jax.lax.top_k(rows_of(x), k),
             f"chunked {TOP_K_CHUNK}": lambda x: chunked_top_k(rows_of(x), k, TOP_K_CHUNK)}
    for f in fanouts:
        top_k[f"preselect {f}"] = functools.partial(lambda x, f: preselected_top_k(rows_of(x), k, f), f=f)
    for bits in radix_bits:
        for c in radix_prechunks:
            for variadic in (True, False) if radix_broadcast else (True,):
                top_k[f"radix {bits} bits, prechunk {c}{'' if variadic else ', broadcast'}"] = functools.partial(
                    lambda x, b, c, v: radix_top_k(rows_of(x), k, b, c, v), b=bits, c=c, v=variadic)
    if kernel_settings:
        from pallas_kernels import top_k as top_k_kernels
    for chunk, warps in kernel_settings:
        plan = top_k_kernels.plan(batch * depth, vocab, k, chunk)
        top_k[f"kernel, chunk {plan.chunk}, {warps} warps, split {plan.split}"] = functools.partial(
            lambda x, c, w: top_k_kernels.top_k(rows_of(x), k, chunk=c, select_warps=w,
                                                interpret=jax.default_backend() != "gpu"), c=chunk, w=warps)
    out = []
    for name, step in top_k.items():
        got_val, got = jax.jit(step)(inputs[0])
        if not (bool(jnp.array_equal(got, want)) and bool(jnp.array_equal(got_val, want_val))):
            raise AssertionError(f"{name} at k={k} differs from lax.top_k")
        out.append({"what": "vocabulary top-k", "budget": budget, "k": k, "variant": name,
                    **time_variant(step, inputs)})
        log(out[-1])
    roots = jnp.zeros((batch,), jnp.int32)
    width = tree_width(budget)
    plain = build_tree(inputs[0], roots, budget, width, preselect=0)
    presets = sorted({0, preselect_fanout(None, k, "gpu")} - {KERNEL_PRESELECT} | set(tree_extra)
                     | {-c for c in radix_prechunks})
    for f in presets + ([KERNEL_PRESELECT] if kernel_settings else []):
        step = functools.partial(lambda x, f: build_tree(x, roots, budget, width, preselect=f), f=f)
        tree = jax.jit(step)(inputs[0])
        if not all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree_util.tree_leaves(tree),
                                                               jax.tree_util.tree_leaves(plain))):
            raise AssertionError(f"the tree at preselect {f}, budget {budget} differs from the chunked one")
        variant = ("kernel" if f == KERNEL_PRESELECT else "chunked" if f == 0 else f"preselect {f}" if f > 0
                   else f"radix, prechunk {-f}")
        out.append({"what": "tree", "budget": budget, "k": k, "variant": variant, **time_variant(step, inputs)})
        log(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--fanouts", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--tree-fanouts", nargs="*", type=int, default=[],
                    help="fan-outs to time whole trees at besides 0 and the default")
    ap.add_argument("--radix-bits", nargs="*", type=int, default=[4],
                    help="tree.radix_top_k's key bits per pass (each is timed)")
    ap.add_argument("--radix-prechunks", nargs="*", type=int, default=[1, 2],
                    help="tree.radix_top_k's preselection chunk, 1 = none (each is timed, and the tree at each)")
    ap.add_argument("--radix-broadcast", action="store_true",
                    help="also time radix_top_k counting by a broadcast compare instead of a variadic reduce")
    ap.add_argument("--kernel", action="store_true",
                    help="also time the Triton kernels (pallas_kernels/top_k.py) and the tree through them")
    ap.add_argument("--kernel-chunks", nargs="+", type=int, default=[32],
                    help="the kernels' largest chunk (each is timed, with --kernel)")
    ap.add_argument("--kernel-warps", nargs="+", type=int, default=[8],
                    help="warps of the kernels' select programs (each is timed, with --kernel)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--sharpness", type=float, default=4.0, help="scale of the random logits")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    inputs = log_probs(args.calls, args.batch, args.depth, args.vocab, args.sharpness)
    rows = []
    for budget in args.budgets:
        kernel_settings = ([(c, w) for c in args.kernel_chunks for w in args.kernel_warps]
                           if args.kernel else [])
        rows += bench_budget(inputs, budget, args.fanouts, args.tree_fanouts, args.radix_bits,
                             args.radix_prechunks, args.radix_broadcast, kernel_settings)
        write_json(args.out, {"env": env, "args": vars(args), "rows": rows})
    print(f"\n{env['device']}, jax {env['jax']}, [{args.batch} x {args.depth}, {args.vocab}] log-probs, "
          f"{args.calls} calls per program")
    print("| what | budget | k | variant | kernel us / call | kernels / call | wall us / call |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['budget']} | {r['k']} | {r['variant']} | {r['kernel_us']:.1f} | "
              f"{r['kernels']:.0f} | {r['wall_us']:.1f} |")


if __name__ == "__main__":
    main()
