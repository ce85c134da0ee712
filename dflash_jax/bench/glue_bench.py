"""The verify layer's glue kernels against the XLA they replace, over their block settings.

* `residual_norm` (`pallas_kernels/residual_norm.py`): a projection's two float32 K-slice
  partials + the residual -> the new residual and its RMS norm, at [W, 4096]; against
  `residual_norm_reference` jitted (what XLA makes of the same ops), for rows per program x warps.
* `split_merge` (`pallas_kernels/split_merge.py`): the Hopper kernel's split-K partials merged
  into tokens, at the Qwen3-8B head shape (8 kv heads x 4, head_dim 128); against the jnp merge,
  for tokens per main / tail program x warps.
* `silu_mul` (`pallas_kernels/silu_mul.py`): silu(gate) * up from the fused gate_up product
  [W, 2, 12288]; against `silu_mul_reference` jitted (XLA's fusion), for columns per program x
  warps.

Each variant runs `--calls` chained calls (one per layer) in one jitted program; reported per
call: the GPU's kernel time from a profiler trace (all kernels of the call) and the wall time.

    python -m dflash_jax.bench.glue_bench --widths 272 --out glue.json
    python -m dflash_jax.bench.glue_bench --widths 257 --kernels silu_mul --silu-cols 1024 2048 4096
"""
from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.common import environment, log, write_json
from dflash_jax.bench.profile import kernel_us
from pallas_kernels import residual_norm as rn
from pallas_kernels import silu_mul as silu
from pallas_kernels import split_merge as sm
from pallas_kernels import tree_attention_hopper as hopper


def _timed(kernel: str, width: int, variant: str, call, calls: int) -> dict:
    """One row: `kernel_us` of the variant's program, or the error of a setting the kernel refuses
    (a row, not a stop)."""
    try:
        k, wall = kernel_us(call, calls)
    except Exception as err:  # noqa: BLE001
        return {"kernel": kernel, "width": width, "variant": variant, "error": repr(err)[:120]}
    row = {"kernel": kernel, "width": width, "variant": variant, "kernel_us": k, "wall_us": wall}
    log(row)
    return row


def residual_variants(width: int, embed: int, rows: list[int], warps: list[int], calls: int) -> list[dict]:
    rng = np.random.default_rng(width)
    x = jnp.asarray(rng.standard_normal((width, embed)), jnp.bfloat16)
    parts = jnp.asarray(rng.standard_normal((2, width, embed)), jnp.float32)
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(embed), jnp.bfloat16)
    variants = {"xla": functools.partial(rn.residual_norm_reference, eps=1e-6)}
    for r, w in itertools.product(rows, warps):
        variants[f"kernel rows {r} warps {w}"] = functools.partial(rn.residual_norm, eps=1e-6, rows=r, num_warps=w)
    out = []
    for name, step in variants.items():
        @jax.jit
        def run(x, parts, weight, step=step):
            kept = []
            for _ in range(calls):  # each norm is the next call's residual; every new residual is returned
                x_new, x = step(x, parts, weight)
                kept.append(x_new)
            return x, tuple(kept)
        k, wall = kernel_us(lambda: run(x, parts, weight), calls)
        out.append({"kernel": "residual_norm", "width": width, "variant": name, "kernel_us": k, "wall_us": wall})
        log(out[-1])
    return out


def merge_variants(width: int, mains: list[int], tails: list[int], warps: list[int], calls: int) -> list[dict]:
    kv_heads, group, head_dim = 8, 4, 128
    sched = hopper.schedule(1, kv_heads, width * group, 5120)
    rng = np.random.default_rng(width)
    out_p = jnp.asarray(rng.standard_normal((1, kv_heads, sched.programs, 128, head_dim)), jnp.bfloat16)
    lse = jnp.asarray(rng.standard_normal((1, kv_heads, sched.programs, 128)), jnp.float32)
    lses = tuple(lse + i for i in range(calls))  # distinct inputs, so no two calls are one
    variants = {"xla": functools.partial(sm.split_merge_reference, sched=sched, width=width, group=group)}
    for m, t, w in itertools.product(mains, tails, warps):
        variants[f"kernel main {m} tail {t} warps {w}"] = functools.partial(
            sm.split_merge, sched=sched, width=width, group=group, main_tokens=m, tail_tokens=t, num_warps=w)
    out = []
    for name, step in variants.items():
        @jax.jit
        def run(out_p, lses, step=step):
            return tuple(step(out_p, one) for one in lses)
        out.append(_timed("split_merge", width, name, lambda: run(out_p, lses), calls))
    return out


def silu_variants(width: int, mlp: int, cols: list[int], warps: list[int], calls: int) -> list[dict]:
    rng = np.random.default_rng(width)
    base = jnp.asarray(rng.standard_normal((width, 2, mlp)), jnp.bfloat16)
    boths = tuple(base + jnp.bfloat16(i / 64) for i in range(calls))  # distinct inputs, one per layer
    variants = {"xla": silu.silu_mul_reference}
    for c, w in itertools.product(cols, warps):
        variants[f"kernel cols {c} warps {w}"] = functools.partial(silu.silu_mul, cols=c, num_warps=w)
    out = []
    for name, step in variants.items():
        @jax.jit
        def run(boths, step=step):
            return tuple(step(one) for one in boths)
        out.append(_timed("silu_mul", width, name, lambda: run(boths), calls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="+", type=int, default=[272])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--main-tokens", nargs="+", type=int, default=[4, 8, 16])
    ap.add_argument("--tail-tokens", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--silu-cols", nargs="+", type=int, default=[1024, 2048, 4096])
    ap.add_argument("--kernels", nargs="+", choices=("residual_norm", "split_merge", "silu_mul"),
                    default=["residual_norm", "split_merge", "silu_mul"])
    ap.add_argument("--calls", type=int, default=36)
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    rows = []
    for width in args.widths:
        if "residual_norm" in args.kernels:
            rows += residual_variants(width, 4096, args.rows, args.warps, args.calls)
        if "split_merge" in args.kernels:
            rows += merge_variants(width, args.main_tokens, args.tail_tokens, args.warps, args.calls)
        if "silu_mul" in args.kernels:
            rows += silu_variants(width, 12288, args.silu_cols, args.warps, args.calls)
        write_json(args.out, {"env": env, "rows": rows})
    print(f"\n{env['device']}, jax {env['jax']}, {args.calls} chained calls per program")
    print("| kernel | W | variant | kernel us / call | wall us / call |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['width']} | {r['variant']} | {r['error']} | |")
        else:
            print(f"| {r['kernel']} | {r['width']} | {r['variant']} | {r['kernel_us']:.2f} | {r['wall_us']:.2f} |")


if __name__ == "__main__":
    main()
