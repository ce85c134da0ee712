"""DDTree's tree on device, and its vocabulary top-k alone, over the ways to take that top-k.

At [batch * 15 depths, vocab] log-probs (the drafter's per-depth distributions of a block of 16)
and k = min(budget, vocab), for each budget:

* the vocabulary top-k alone: `tree.chunked_top_k` (chunks of 2048, the tree's way until the
  eighteenth session) and `tree.preselected_top_k` at each `--fanouts` value;
* the whole tree (`tree.build_tree`) with `preselect` 0 (chunked), the default fan-out for k on
  a GPU and each `--tree-fanouts` value.

Each variant runs `--calls` calls on distinct inputs in one jitted program; reported per call:
the GPU's kernel time from a profiler trace (all kernels of the call) and the wall time. Every
variant's indices are checked against `lax.top_k` (and every tree against the chunked one)
before it is timed.

    python -m dflash_jax.bench.top_k_bench --budgets 16 64 256 512 --out top_k.json
"""
from __future__ import annotations

import argparse
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.common import environment, log, write_json
from dflash_jax.bench.profile import kernel_us
from dflash_jax.tree import (TOP_K_CHUNK, build_tree, chunked_top_k, preselect_fanout, preselected_top_k,
                             tree_width)


def log_probs(calls: int, batch: int, depth: int, vocab: int, sharpness: float) -> tuple[jax.Array, ...]:
    """`calls` distinct [batch, depth, vocab] float32 log-probs, drawn on the device."""
    keys = jax.random.split(jax.random.key(0), calls)
    draw = jax.jit(lambda k: jax.nn.log_softmax(
        sharpness * jax.random.normal(k, (batch, depth, vocab), jnp.float32), -1))
    return tuple(jax.block_until_ready(draw(k)) for k in keys)


def time_variant(step: Callable[[jax.Array], tuple], inputs: tuple[jax.Array, ...]) -> tuple[float, float]:
    run = jax.jit(lambda xs: tuple(step(x) for x in xs))
    return kernel_us(lambda: run(inputs), len(inputs))


def bench_budget(inputs: tuple[jax.Array, ...], budget: int, fanouts: list[int],
                 tree_extra: list[int]) -> list[dict]:
    batch, depth, vocab = inputs[0].shape
    k = min(budget, vocab)
    rows_of = lambda x: x.reshape(batch * depth, vocab)
    want = jax.lax.top_k(rows_of(inputs[0]), k)[1]
    top_k = {f"chunked {TOP_K_CHUNK}": lambda x: chunked_top_k(rows_of(x), k, TOP_K_CHUNK)}
    for f in fanouts:
        top_k[f"preselect {f}"] = functools.partial(lambda x, f: preselected_top_k(rows_of(x), k, f), f=f)
    out = []
    for name, step in top_k.items():
        got = jax.jit(step)(inputs[0])[1]
        if not bool(jnp.array_equal(got, want)):
            raise AssertionError(f"{name} at k={k} differs from lax.top_k")
        kern, wall = time_variant(step, inputs)
        out.append({"what": "vocabulary top-k", "budget": budget, "k": k, "variant": name,
                    "kernel_us": kern, "wall_us": wall})
        log(out[-1])
    roots = jnp.zeros((batch,), jnp.int32)
    width = tree_width(budget)
    plain = build_tree(inputs[0], roots, budget, width, preselect=0)
    for f in sorted({0, preselect_fanout(None, k, "gpu")} | set(tree_extra)):
        step = functools.partial(lambda x, f: build_tree(x, roots, budget, width, preselect=f), f=f)
        tree = jax.jit(step)(inputs[0])
        if not all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree_util.tree_leaves(tree),
                                                               jax.tree_util.tree_leaves(plain))):
            raise AssertionError(f"the tree at preselect {f}, budget {budget} differs from the chunked one")
        kern, wall = time_variant(step, inputs)
        out.append({"what": "tree", "budget": budget, "k": k,
                    "variant": f"preselect {f}" if f else "chunked",
                    "kernel_us": kern, "wall_us": wall})
        log(out[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", nargs="+", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--fanouts", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--tree-fanouts", nargs="*", type=int, default=[],
                    help="fan-outs to time whole trees at besides 0 and the default")
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
        rows += bench_budget(inputs, budget, args.fanouts, args.tree_fanouts)
        write_json(args.out, {"env": env, "args": vars(args), "rows": rows})
    print(f"\n{env['device']}, jax {env['jax']}, [{args.batch} x {args.depth}, {args.vocab}] log-probs, "
          f"{args.calls} calls per program")
    print("| what | budget | k | variant | kernel us / call | wall us / call |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['budget']} | {r['k']} | {r['variant']} | {r['kernel_us']:.1f} | "
              f"{r['wall_us']:.1f} |")


if __name__ == "__main__":
    main()
