"""DDTree's tree on device, and its vocabulary top-k alone, over the ways to take that top-k.

At [batch * 15 depths, vocab] log-probs (the drafter's per-depth distributions of a block of 16)
and k = min(budget, vocab), for each budget:

* the vocabulary top-k alone: `lax.top_k` itself, `tree.chunked_top_k` (chunks of 2048, the
  tree's way off a GPU), and the Triton kernels (`pallas_kernels.top_k.top_k`, two launches,
  the tree's way on a GPU) at each `--kernel-chunks` x `--kernel-warps` value (their select
  kernel's warps);
* the whole tree (`tree.build_tree`'s program) with its vocabulary top-k by `chunked_top_k` and
  by the kernels (`tree.kernel_top_k`, the kernels' defaults).

Each variant runs `--calls` calls on distinct inputs in one jitted program; reported per call:
the GPU's kernel time from a profiler trace (all kernels of the call), the number of kernels
and the wall time. Every variant's indices are checked against `lax.top_k` (and the kernel's
tree against the chunked one) before it is timed.

    python -m dflash_jax.bench.top_k_bench --budgets 16 64 256 512 --out top_k.json
"""
from __future__ import annotations

import argparse
import functools
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax import tree as tree_module
from dflash_jax.bench.common import environment, log, time_fn, write_json
from dflash_jax.bench.profile import kernel_events
from dflash_jax.tree import TOP_K_CHUNK, chunked_top_k, tree_width
from pallas_kernels import top_k as top_k_kernels


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


def bench_budget(inputs: tuple[jax.Array, ...], budget: int, kernel_settings: list[tuple[int, int]]
                 ) -> list[dict]:
    """Rows of the table for one budget. kernel_settings: (chunk, select warps) pairs for the
    Triton kernels."""
    batch, depth, vocab = inputs[0].shape
    k = min(budget, vocab)
    rows_of = lambda x: x.reshape(batch * depth, vocab)  # noqa: E731
    interpret = jax.default_backend() != "gpu"
    want_val, want = jax.lax.top_k(rows_of(inputs[0]), k)
    top_k = {"lax.top_k": lambda x: jax.lax.top_k(rows_of(x), k),
             f"chunked {TOP_K_CHUNK}": lambda x: chunked_top_k(rows_of(x), k, TOP_K_CHUNK)}
    for chunk, warps in kernel_settings:
        plan = top_k_kernels.plan(batch * depth, vocab, k, chunk)
        top_k[f"kernel, chunk {plan.chunk}, {warps} warps, split {plan.split}"] = functools.partial(
            lambda x, c, w: top_k_kernels.top_k(rows_of(x), k, chunk=c, select_warps=w, interpret=interpret),
            c=chunk, w=warps)
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
    trees = {"chunked": None, "kernel": jax.default_backend()}  # `_build_tree`'s kernel_backend

    def build(x: jax.Array, backend: str | None):
        return tree_module._build_tree(x, roots, budget=budget, width=width, top_k_chunk=TOP_K_CHUNK,
                                       rank_max=tree_module.RANK_TOP_K_MAX, kernel_backend=backend)

    plain = build(inputs[0], None)
    for variant, backend in trees.items():
        step = functools.partial(build, backend=backend)
        tree = jax.jit(step)(inputs[0])
        if not all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree_util.tree_leaves(tree),
                                                               jax.tree_util.tree_leaves(plain))):
            raise AssertionError(f"the tree with the {variant} top-k, budget {budget} differs from the chunked one")
        out.append({"what": "tree", "budget": budget, "k": k, "variant": variant, **time_variant(step, inputs)})
        log(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--kernel-chunks", nargs="+", type=int, default=[32],
                    help="the kernels' largest chunk (each is timed)")
    ap.add_argument("--kernel-warps", nargs="+", type=int, default=[8],
                    help="warps of the kernels' select programs (each is timed)")
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
        kernel_settings = [(c, w) for c in args.kernel_chunks for w in args.kernel_warps]
        rows += bench_budget(inputs, budget, kernel_settings)
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
