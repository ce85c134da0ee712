"""Benchmark of the tree-GDN verify: the Pallas kernels (pallas_kernels.tree_gdn) against XLA.

Shape: a hybrid target's GDN layers (default Qwen3.6-27B: 16 key heads, 48 value heads, dk = dv =
128, 48 GDN layers), batch 1, W nodes of a random draft tree.

    python -m dflash_jax.bench.gdn_verify_bench --out gdn_verify.json               # H200, ~2 min
    python -m dflash_jax.bench.gdn_verify_bench --model tiny-hybrid --widths 5 17 --interpret

Two programs are timed per W and implementation, each running every GDN layer's work in one jit
(a fori_loop over the layers whose committed state feeds the next layer, as the state of one
layer feeds its next round), so Python dispatch is out of the numbers:
- "verify": what the model's verify and commit run per GDN layer for the recurrence: `gdn.gates`
  -> `gdn.tree_verify` -> `gdn.commit_state` (the conv and projections are the same either way);
- "chunk": the verify chunk alone (`tree_gdn`: K S0 ... O, the part the kernel replaces).
Reported: medians (after warm-up) of the time per layer, the kernel's speedup, and the largest
difference between the two implementations' outputs and committed states. `--profile` adds each
chunk's kernels from a profiler trace (device us and launches per layer, and the jax op each
came from): which launch the time is in. `--tilings` also times the chunk at other tilings and
dot precisions of the kernel (`pallas_kernels.tree_gdn.BlockSizes`), each with the largest
difference of its chained state from XLA's.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import gdn
from dflash_jax.bench.common import SHAPES, environment, log, time_fn, write_json
from dflash_jax.bench.profile import profile_program
from dflash_jax.bench.tree_attention_bench import random_tree_visibility
from dflash_jax.qwen3_5 import Qwen35Config
from pallas_kernels.tree_gdn import PRECISIONS, BlockSizes, default_block_sizes, tree_gdn, tree_gdn_pallas


def make_inputs(cfg: Qwen35Config, width: int, dtype: Any, seed: int = 0) -> dict[str, jax.Array]:
    """Random per-layer inputs of one verify, batch 1: q, k [1, W, Hk, dk] and v [1, W, Hv, dv]
    (unnormalised, in the activation dtype), a, b [1, W, Hv], the gate weights, the float32 state
    [1, Hv, dk, dv], a random tree's visibility and its deepest node's path (the accepted one)."""
    keys = jax.random.split(jax.random.key(seed), 8)
    hk, hv, dk, dv = cfg.gdn_key_heads, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim
    visible = random_tree_visibility(np.random.default_rng(seed), 1, width)
    last = np.argmax(visible.sum(axis=-1), axis=-1)
    return dict(
        q=jax.random.normal(keys[0], (1, width, hk, dk), dtype), k=jax.random.normal(keys[1], (1, width, hk, dk), dtype),
        v=jax.random.normal(keys[2], (1, width, hv, dv), dtype), a=jax.random.normal(keys[3], (1, width, hv), dtype),
        b=jax.random.normal(keys[4], (1, width, hv), dtype),
        a_log=jax.random.uniform(keys[5], (hv,), jnp.float32, -2.0, 1.0), dt_bias=jax.random.normal(keys[6], (hv,)),
        state=0.1 * jax.random.normal(keys[7], (1, hv, dk, dv), jnp.float32),
        visible=jnp.asarray(visible), path=jnp.asarray(visible[np.arange(1), last]),
        last=jnp.asarray(last, jnp.int32))


def verify_layers(x: dict[str, jax.Array], layers: int, impl: str) -> tuple[jax.Array, jax.Array]:
    """`layers` GDN verifies and commits, each from the previous one's committed state.
    Returns (the last layer's outputs [1, W, Hv, dv], its committed state)."""
    def layer(_, carry):
        _, state = carry
        g, beta = gdn.gates(x["a"], x["b"], x["a_log"], x["dt_bias"])
        out, kept = gdn.tree_verify(x["q"], x["k"], x["v"], g, beta, state, x["visible"], impl=impl)
        return out, gdn.commit_state(state, kept, x["path"], x["last"])

    out0 = jnp.zeros(x["v"].shape, jnp.float32)
    return jax.lax.fori_loop(0, layers, layer, (out0, x["state"]))


def chunk_inputs(x: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """The verify chunk's own inputs (heads-major, normalised q and k, float32), made once."""
    f32 = jnp.float32
    norm = lambda t: t * jax.lax.rsqrt(jnp.sum(t * t, axis=-1, keepdims=True) + gdn.L2_EPS)
    q = norm(x["q"].astype(f32)) * x["q"].shape[-1] ** -0.5
    g, beta = gdn.gates(x["a"], x["b"], x["a_log"], x["dt_bias"])
    decay = jnp.einsum("bts,bsh->bht", x["visible"].astype(f32), g)
    major = lambda t: t.transpose(0, 2, 1, 3)
    return (major(q), major(norm(x["k"].astype(f32))), major(x["v"].astype(f32)), beta.transpose(0, 2, 1),
            decay, x["visible"])


def chunk_layers(args: tuple[jax.Array, ...], state: jax.Array, layers: int, impl: str,
                 tiling: BlockSizes | None = None) -> jax.Array:
    """`layers` verify chunks in a chain: each one's U (scaled down) is the next one's state,
    so XLA can neither hoist nor drop any of them. tiling: the kernel's instead of its defaults."""
    def layer(_, s):
        if tiling is None:
            _, u = tree_gdn(*args, s, impl=impl)
        else:
            _, u = tree_gdn_pallas(*args, s, **dataclasses.asdict(tiling), interpret=impl == "interpret")
        return s + 1e-3 * jnp.mean(u, axis=2, keepdims=True)

    return jax.lax.fori_loop(0, layers, layer, state)


def tiling_name(blocks: BlockSizes) -> str:
    """BLOCK,BLOCK_V,WARPS,STAGES,PRECISION[,share], the --tilings spelling."""
    name = f"{blocks.block},{blocks.block_v},{blocks.num_warps},{blocks.num_stages},{blocks.precision}"
    return name + ",share" if blocks.share_keys else name


def parse_tiling(spec: str, default: BlockSizes) -> BlockSizes:
    """BLOCK,BLOCK_V,WARPS[,STAGES[,PRECISION[,share]]]; STAGES and PRECISION default to
    `default`'s, and "share" sets share_keys. Raises ValueError on another form."""
    fields = spec.split(",")
    if not 3 <= len(fields) <= 6 or fields[5:] not in ([], ["share"]):
        raise ValueError(spec)
    block, block_v, warps = (int(n) for n in fields[:3])
    stages = int(fields[3]) if len(fields) > 3 else default.num_stages
    precision = fields[4] if len(fields) > 4 else default.precision
    if precision not in PRECISIONS:
        raise ValueError(spec)
    return BlockSizes(block=block, block_v=block_v, num_warps=warps, num_stages=stages, precision=precision,
                      share_keys=len(fields) == 6)


def kernel_table(fn: Any, compiled_text: str, layers: int, top: int = 8) -> list[list[Any]] | str:
    """The `top` costliest kernels of `fn()` (a chain of `layers` chunks) as [name, device us per
    layer, launches per layer, the jax op it came from (its name scope)], or the profiler's error."""
    p = profile_program(fn, compiled_text, calls=3, table=top)
    if "error" in p:
        return str(p["error"])
    return [[name, round(ms * 1e3 / layers, 2), launches / layers, op] for name, ms, launches, _, op in p["kernels"]]


def bench_width(cfg: Qwen35Config, width: int, dtype: Any, kernel_impl: str | None, warmup: int,
                iters: int, tilings: list[str], profile: bool = False) -> dict[str, Any]:
    """One W: XLA, the kernel at its default tiling (kernel_impl None: XLA alone), and the chunk
    at each of `tilings`. A kernel that fails (a tiling the GPU refuses, say) leaves its error in
    the row instead of its times.
    profile: also each chunk's kernel table (`kernel_table`) as chunk_xla_kernels / chunk_kernel_kernels."""
    layers = len(cfg.gdn_layers)
    x = make_inputs(cfg, width, dtype)
    blocks = default_block_sizes(1, cfg.gdn_value_heads, width, cfg.gdn_key_dim, cfg.gdn_value_dim)
    row: dict[str, Any] = {"width": width, "layers": layers, "tiling": tiling_name(blocks),
                           "tilings_chunk_us": {}, "tilings_max_diff": {}}
    args = chunk_inputs(x)
    per_layer = lambda fn: time_fn(fn, warmup, iters)["median_ms"] * 1e3 / layers
    results, chunks = {}, {}
    for name, impl in (("xla", "reference"), ("kernel", kernel_impl))[:2 if kernel_impl else 1]:
        verify = jax.jit(functools.partial(verify_layers, layers=layers, impl=impl))
        try:
            results[name] = verify(x)
            row[f"verify_{name}_us"] = per_layer(lambda: verify(x))
            # Compiled once: the program timed is the one whose HLO names the profile's kernels.
            chunk = chunks[name] = jax.jit(functools.partial(chunk_layers, layers=layers, impl=impl)).lower(
                args, x["state"]).compile()
            row[f"chunk_{name}_us"] = per_layer(lambda: chunk(args, x["state"]))
            if profile:
                row[f"chunk_{name}_kernels"] = kernel_table(lambda: chunk(args, x["state"]), chunk.as_text(), layers)
        except Exception as e:  # noqa: BLE001 -- a kernel the GPU refuses is a result; XLA's failure is not
            if name == "xla":
                raise
            row["kernel_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"W={width}: the kernel at its default tiling failed: {row['kernel_error']}")
    if "kernel" in results:
        for part in ("verify", "chunk"):
            row[f"{part}_speedup"] = row[f"{part}_xla_us"] / row[f"{part}_kernel_us"]
        (out_x, state_x), (out_k, state_k) = results["xla"], results["kernel"]
        row["max_abs_diff_out"] = float(jnp.max(jnp.abs(out_x - out_k)))
        row["max_abs_diff_state"] = float(jnp.max(jnp.abs(state_x - state_k)))
    chunk_xla = chunks["xla"](args, x["state"]) if tilings else None
    for spec in tilings:
        tiling = parse_tiling(spec, blocks)
        name = tiling_name(tiling)
        try:
            chunk = jax.jit(functools.partial(chunk_layers, layers=layers, impl=kernel_impl, tiling=tiling))
            # The chained state after every layer, against XLA's: a fast tiling must also be right.
            row["tilings_max_diff"][name] = float(jnp.max(jnp.abs(chunk(args, x["state"]) - chunk_xla)))
            row["tilings_chunk_us"][name] = per_layer(lambda: chunk(args, x["state"]))
            log(f"W={width}: tiling {name}: {row['tilings_chunk_us'][name]:.1f} us/layer, "
                f"max diff {row['tilings_max_diff'][name]:.2g}")
        except Exception as e:  # noqa: BLE001 -- a tiling the GPU refuses (e.g. its shared memory) is a result
            row["tilings_chunk_us"][name] = f"{type(e).__name__}: {str(e)[:200]}"
            log(f"W={width}: tiling {name} failed: {row['tilings_chunk_us'][name]}")
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| W | verify XLA us | verify kernel us | speedup | chunk XLA us | chunk kernel us | speedup | "
             "max diff | tiling | other tilings (chunk us) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        others = ", ".join(f"{t}: {us:.1f}" if isinstance(us, float) else f"{t}: failed"
                           for t, us in r["tilings_chunk_us"].items())
        if "verify_kernel_us" not in r and "kernel_error" not in r:
            kernel = "- | - | {:.1f} | - | - | - ".format(r["chunk_xla_us"])
        elif "kernel_error" in r:
            kernel = "failed | - | {:.1f} | failed | - | - ".format(r["chunk_xla_us"])
        else:
            kernel = (f"{r['verify_kernel_us']:.1f} | {r['verify_speedup']:.2f}x | {r['chunk_xla_us']:.1f} | "
                      f"{r['chunk_kernel_us']:.1f} | {r['chunk_speedup']:.2f}x | "
                      f"{max(r['max_abs_diff_out'], r['max_abs_diff_state']):.2g} ")
        lines.append(f"| {r['width']} | {r['verify_xla_us']:.1f} | {kernel}| {r['tiling']} | {others} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.6-27b", help="a hybrid shape of bench.common.SHAPES")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 64, 257], help="tree nodes W (budget + 1)")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype of q, k, v (the state is float32)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--interpret", action="store_true", help="the kernel in Pallas' interpreter (CPU smoke test)")
    p.add_argument("--tilings", nargs="*", default=[], metavar="BLOCK,BLOCK_V,WARPS[,STAGES[,PRECISION[,share]]]",
                   help="kernel tilings to time the chunk with, beside the default one (STAGES and PRECISION, "
                        f"one of {', '.join(PRECISIONS)}, default to the default tiling's; 'share' makes one "
                        "block-kernel program per key head; one that fails is reported with its error)")
    p.add_argument("--profile", action="store_true",
                   help="also each chunk's costliest kernels from a profiler trace (device us and launches per layer)")
    p.add_argument("--no-kernel", action="store_true", help="time XLA alone (no kernel, no --tilings)")
    p.add_argument("--out", help="JSON file for the results")
    a = p.parse_args(argv)
    cfg = SHAPES.get(a.model)
    if not isinstance(cfg, Qwen35Config):
        p.error(f"--model {a.model!r} is not a hybrid shape; hybrid shapes: "
                f"{sorted(n for n, c in SHAPES.items() if isinstance(c, Qwen35Config))}")
    if a.no_kernel and a.tilings:
        p.error("--tilings times the kernel: it does not go with --no-kernel")
    if min(a.widths) < 1:
        p.error(f"--widths must be >= 1, got {a.widths}")
    probe = BlockSizes(block=16, block_v=16, num_warps=4, num_stages=1, precision=PRECISIONS[0], share_keys=False)
    for spec in a.tilings:
        try:
            parse_tiling(spec, probe)
        except ValueError:
            p.error(f"--tilings takes BLOCK,BLOCK_V,WARPS[,STAGES[,PRECISION[,share]]] with ints and PRECISION one "
                    f"of {', '.join(PRECISIONS)}, got {spec!r}")
    rows = []
    for width in a.widths:
        kernel = None if a.no_kernel else "interpret" if a.interpret else "pallas"
        rows.append(bench_width(cfg, width, jnp.dtype(a.dtype), kernel, a.warmup, a.iters, a.tilings, a.profile))
        r = rows[-1]
        log(f"W={width}: verify {r['verify_xla_us']:.1f} -> {r.get('verify_kernel_us', float('nan')):.1f} us/layer, "
            f"chunk {r['chunk_xla_us']:.1f} -> {r.get('chunk_kernel_us', float('nan')):.1f}")
    record = {"env": environment(), "model": a.model, "dtype": a.dtype, "interpret": a.interpret,
              "gdn": {"key_heads": cfg.gdn_key_heads, "value_heads": cfg.gdn_value_heads,
                      "dk": cfg.gdn_key_dim, "dv": cfg.gdn_value_dim}, "rows": rows}
    print(markdown(rows))
    write_json(a.out, record)
    return record


if __name__ == "__main__":
    main()
