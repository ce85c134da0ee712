"""The qkv epilogue kernel (`pallas_kernels/qkv_epilogue.py`) against the same steps in XLA.

For each tree width, at the Qwen3-8B head shape (8 kv heads x 4 q heads, head_dim 128, qk norms)
with a 4096-token prefix: XLA's composition (`qkv_epilogue_reference`, jitted) and the kernel at
every (tokens per program, warps) asked for. Each variant runs `--calls` chained calls unrolled
in one jitted program (the caches updated in place, q's rows summed so that none is dead code);
reported per call: the median wall time, the GPU's kernel time from a profiler trace of that
program (the sum included), and the kernel's own time.

    python -m dflash_jax.bench.epilogue_bench --widths 32 80 272 528 --tokens 4 8 16 32 --warps 1 2 4 8
"""
from __future__ import annotations

import argparse
import functools
import itertools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.common import environment, log, time_fn, write_json
from dflash_jax.bench.profile import kernel_events
from dflash_jax.config import RopeConfig
from dflash_jax.rope import rope_tables
from pallas_kernels.qkv_epilogue import NUM_WARPS, qkv_epilogue, qkv_epilogue_reference, token_block
from pallas_kernels.tree_attention_hopper import ROWS_PER_BLOCK


def inputs(width: int, kv_heads: int, group: int, head_dim: int, prefix: int, max_len: int, dtype):
    rng = np.random.default_rng(width)
    qkv = jnp.asarray(rng.standard_normal((1, width, kv_heads, group + 2, head_dim)), dtype)
    norms = [jnp.asarray(1 + 0.1 * rng.standard_normal(head_dim), dtype) for _ in range(2)]
    positions = prefix + jnp.asarray(rng.integers(0, 16, (1, width)), jnp.int32)
    cos, sin = rope_tables(positions, RopeConfig(theta=1e6), head_dim)
    cache = jnp.zeros((1, max_len, kv_heads, head_dim), dtype)
    return qkv, norms, cos, sin, cache, jnp.full((1,), prefix, jnp.int32)


def program(step, calls: int):
    """`calls` chained epilogues in one program; q_rows is carried so nothing is dead code."""
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def run(k_cache, v_cache, q_rows, qkv, q_norm, k_norm, cos, sin, starts):
        for _ in range(calls):
            rows, k_cache, v_cache = step(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, starts)
            q_rows = q_rows + rows
        return k_cache, v_cache, q_rows
    return run


def measure(step, args, calls: int) -> dict:
    qkv, (q_norm, k_norm), cos, sin, cache, starts = args
    run = program(step, calls)
    box = {"state": (jnp.array(cache), jnp.array(cache))}
    padded = step.keywords["padded_rows"]
    rows0 = jnp.zeros((1, qkv.shape[2], padded, qkv.shape[-1]), qkv.dtype)

    def call():
        k, v, rows = run(*box["state"], rows0, qkv, q_norm, k_norm, cos, sin, starts)
        box["state"] = (k, v)
        return rows
    wall = time_fn(call, warmup=2, iters=10)
    trace = tempfile.mkdtemp()
    with jax.profiler.trace(trace, create_perfetto_trace=True):
        jax.block_until_ready(call())
    events = kernel_events(trace)
    kernel_us = sum(float(e.get("dur", 0.0)) for e in events) / calls
    own_us = sum(float(e.get("dur", 0.0)) for e in events if "qkv_epilogue" in e["name"]) / calls
    return {"wall_us": wall["median_ms"] * 1e3 / calls, "kernel_us": kernel_us, "epilogue_kernel_us": own_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="+", type=int, default=[32, 80, 272, 528])
    ap.add_argument("--tokens", nargs="+", type=int, default=[4, 8, 16, 32])
    ap.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--calls", type=int, default=36, help="chained calls per program (36: one per layer)")
    ap.add_argument("--interpret", action="store_true", help="the kernel in interpret mode: a CPU dry run")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    kv_heads, group, head_dim, prefix = 8, 4, 128, 4096
    rows = []
    for width in args.widths:
        max_len = prefix + width + 256
        padded = -(-width * group // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
        data = inputs(width, kv_heads, group, head_dim, prefix, max_len, jnp.bfloat16)
        variants = [("xla", functools.partial(qkv_epilogue_reference, eps=1e-6, padded_rows=padded))]
        for tokens, warps in itertools.product(args.tokens, args.warps):
            if padded % (tokens * group) == 0:
                variants.append((f"kernel t{tokens} w{warps}",
                                 functools.partial(qkv_epilogue, eps=1e-6, padded_rows=padded, tokens=tokens,
                                                   num_warps=warps, interpret=args.interpret)))
        for name, step in variants:
            row = {"width": width, "variant": name, **measure(step, data, args.calls)}
            if name == f"kernel t{token_block(group)} w{NUM_WARPS}":
                row["variant"] += " (default)"
            log(row)
            rows.append(row)
        write_json(args.out, {"env": env, "rows": rows})
    print(f"\n{env['device']}, jax {env['jax']}, 8 kv heads x 4, head_dim 128, prefix {prefix}, bf16, "
          f"{args.calls} calls per program")
    print("| W | variant | wall us / call | kernel us / call | the epilogue kernel's own us |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['width']} | {r['variant']} | {r['wall_us']:.1f} | {r['kernel_us']:.1f} | "
              f"{r['epilogue_kernel_us']:.1f} |")


if __name__ == "__main__":
    main()
