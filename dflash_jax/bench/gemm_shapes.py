"""The verify pass's matrix products, one at a time, at the target's shape.

A DDTree(256) round spends about 6.4 of its 11.5 ms in the target's GEMMs at M = 272 rows
(BENCHMARKS.md, fourteenth session). This times each of them alone, as XLA compiles it, to see
what the library picks and how far from the matrix rate each lands:

* `layout`: the weight stored [in, out] (as the model keeps it: `x @ w`) or [out, in] (as
  checkpoints and PyTorch keep it: `x @ w.T`), which changes the operands' majorness that
  cuBLAS sees and so the kernels it may choose;
* with the op that follows it in the layer fused or not (`+res`: the residual add; `+silu`:
  SiLU(gate) * up), to see which of them XLA folds into the GEMM;
* `--splits`: as `splits` products over slices of K, float32 partials out (as
  `model.split_k_product` asks for them), the sum left to the consumer (not timed);
* `lm_head+argmax:f32` / `:bf16` / `:bf16-out`: the LM head and the greedy argmax over its
  float32 logits, over those rounded to bf16 after, or over the product asked for in bf16
  (`model.logits_from_hidden`);
* `gate_up:batched` / `gate_up:halves`: the gate_up product over weights [2, in, mlp] as one
  batched product (batch 2: gate and up) or as two products, to see whether cuBLAS then picks a
  kernel without the Memset it launches before the fused product's;
* `--xla-options`: XLA compile options per variant (e.g. `xla_gpu_enable_cublaslt=true`, or
  `xla_gpu_dump_autotune_logs_to=PATH` for every algorithm the autotuner timed);
* `gate_up+silu:kernel`: the same step as `gate_up+silu` by `pallas_kernels.gate_up_silu` (one
  Mosaic GPU launch; weights [2, mlp, in], the rows padded to its tiles before the program).

Each variant runs `--layers` products with distinct weights (so no weight is read from L2) in
one jitted program with XLA's dot merger off (it would merge products that share an input).
Reported per product: the GPU's kernel time from a profiler trace (gaps excluded), the kernels
launched, TFLOP/s, and the wall time of the whole program per product (gaps included).

    python -m dflash_jax.bench.gemm_shapes --rows 272 256 --out gemm.json
"""
from __future__ import annotations

import argparse
import itertools
import tempfile
from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax.bench.common import environment, log, time_fn, write_json
from dflash_jax.bench.profile import kernel_events
from dflash_jax.bench.spec_round import add_xla_options_argument, parse_xla_options
from dflash_jax.speculative import DOT_MERGER_OFF

# (name, in, out, what follows the product) at the Qwen3-8B shape.
PRODUCTS = {
    "qkv": (4096, 6144, None),
    "o": (4096, 4096, None),
    "o+res": (4096, 4096, "res"),
    "gate_up": (4096, 24576, None),
    "gate_up:batched": (4096, 24576, "batched"),
    "gate_up:halves": (4096, 24576, "halves"),
    "gate_up+silu": (4096, 24576, "silu"),
    "gate_up+silu:kernel": (4096, 24576, "silu-kernel"),
    "gate_up+silu:kernel-pdl": (4096, 24576, "silu-kernel-pdl"),
    "gate_up+silu:kernel-pair": (4096, 24576, "silu-kernel-pair"),
    "gate_up+silu:kernel-pair-pdl": (4096, 24576, "silu-kernel-pair-pdl"),
    "gate_up+silu:kernel-pair-s4": (4096, 24576, "silu-kernel-pair-s4"),
    "gate_up+silu:kernel-pair-rows": (4096, 24576, "silu-kernel-pair-rows"),
    "gate_up+silu:kernel-persist": (4096, 24576, "silu-kernel-persist"),
    "gate_up+silu:kernel-pair-persist": (4096, 24576, "silu-kernel-pair-persist"),
    "gate_up+silu:kernel-pair-persist-pdl": (4096, 24576, "silu-kernel-pair-persist-pdl"),
    "gate_up+silu:kernel-pingpong": (4096, 24576, "silu-kernel-pingpong"),
    "gate_up+silu:kernel-pingpong-pdl": (4096, 24576, "silu-kernel-pingpong-pdl"),
    "gate_up+silu:kernel-pingpong-s4": (4096, 24576, "silu-kernel-pingpong-s4"),
    "gate_up+silu:kernel-pingpong-s6": (4096, 24576, "silu-kernel-pingpong-s6"),
    "gate_up+silu:kernel-pingpong-s6-pdl": (4096, 24576, "silu-kernel-pingpong-s6-pdl"),
    "down": (12288, 4096, None),
    "down+res": (12288, 4096, "res"),
    "lm_head": (4096, 151936, "f32"),
    # The verify's LM head and greedy choice: float32 logits, or rounded to bf16 first
    # (`model.logits_from_hidden`, as transformers' bf16 lm_head), then the argmax.
    "lm_head+argmax:f32": (4096, 151936, "argmax-f32"),
    "lm_head+argmax:bf16": (4096, 151936, "argmax-bf16"),
    "lm_head+argmax:bf16-out": (4096, 151936, "argmax-bf16-out"),
}


def product(x: jax.Array, w: jax.Array, layout: str, after: str | None, res: jax.Array, splits: int = 1
            ) -> jax.Array:
    """x [rows, in] times w ([in, out] or [out, in]), then `after`; or with `splits` > 1 the
    float32 partials [splits, rows, out] of that many slices of `in`."""
    if splits > 1:
        rows, k = x.shape
        xs = x.reshape(rows, splits, k // splits)
        ws = w.reshape(splits, k // splits, -1) if layout == "in_out" else w.reshape(-1, splits, k // splits)
        eq = "tsk,sko->sto" if layout == "in_out" else "tsk,osk->sto"
        return jnp.einsum(eq, xs, ws, preferred_element_type=jnp.float32)
    if after and after.startswith("silu-kernel"):  # w: [2, mlp, in]; x padded to the kernel's tiles
        return _kernel_product(x, w, after.split("-")[2:])
    eq = "ti,io->to" if layout == "in_out" else "ti,oi->to"
    if after == "halves":  # w: [2, in, mlp] or [2, mlp, in]
        return tuple(jnp.einsum(eq, x, w[h], preferred_element_type=x.dtype) for h in range(2))
    if after == "batched":
        return jnp.einsum(eq.replace(",", ",h").replace("->", "->h"), x, w, preferred_element_type=x.dtype)
    if after == "f32":
        return jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)
    if after and after.startswith("argmax"):
        if after == "argmax-bf16-out":  # the product itself in bf16 (float32 accumulation)
            logits = jnp.einsum(eq, x, w, preferred_element_type=x.dtype).astype(jnp.float32)
        else:
            logits = jnp.einsum(eq, x, w, preferred_element_type=jnp.float32)
        if after == "argmax-bf16":
            logits = logits.astype(x.dtype).astype(jnp.float32)
        return jnp.argmax(logits, -1).astype(jnp.int32)
    y = jnp.einsum(eq, x, w, preferred_element_type=x.dtype)
    if after == "res":
        return res + y
    if after == "silu":  # as model.mlp: both halves rounded to bf16, then SiLU in float32
        half = y.shape[-1] // 2
        g, u = y[:, :half].astype(jnp.float32), y[:, half:].astype(jnp.float32)
        return (jax.nn.silu(g) * u).astype(x.dtype)
    return y


def _kernel_product(x: jax.Array, w: jax.Array, opts: list[str]) -> jax.Array:
    """`pallas_kernels.gate_up_silu` with the tile options named in a product's name: pdl,
    pair (clusters of two sharing the weights), s4 / s6 (4 / 6 stages), persist (one program per SM,
    taking jobs in turn), pingpong (the compute warpgroups taking jobs in turn, one program per
    SM); x comes padded to whole tiles,
    but for "rows" (padded to a multiple of 8 only, the last tile partial)."""
    import dataclasses
    from pallas_kernels.gate_up_silu import gate_up_silu_kernel, token_tiles
    tiles = dataclasses.replace(token_tiles(x.shape[0]), pdl="pdl" in opts, pair="pair" in opts,
                                stages=4 if "s4" in opts else 6 if "s6" in opts else 5, pingpong="pingpong" in opts,
                                programs=132 if "persist" in opts or "pingpong" in opts else 0)
    return gate_up_silu_kernel(x, w, tiles=tiles)


def program(layout: str, after: str | None, splits: int) -> Callable:
    """The jitted program's `lower`: one product per weight, as `product`."""
    def run(x, res, weights):
        return tuple(product(x, w, layout, after, res, splits) for w in weights)
    return jax.jit(run).lower


def measure(name: str, rows: int, layout: str, layers: int, calls: int, splits: int = 1,
            xla_options: str = "") -> dict:
    d_in, d_out, after = PRODUCTS[name]
    n = layers if not name.startswith("lm_head") else min(layers, 4)
    keys = jax.random.split(jax.random.key(rows), n + 2)
    shape = (d_in, d_out) if layout == "in_out" else (d_out, d_in)
    if after and after.startswith("silu-kernel"):
        from pallas_kernels.gate_up_silu import token_tiles
        shape = (2, d_out // 2, d_in)
        tokens = token_tiles(rows).tokens
        x_rows = -(-rows // 8) * 8 if after.endswith("rows") else -(-rows // tokens) * tokens
    else:
        x_rows = rows
        if after in ("batched", "halves"):  # gate and up as two weights
            shape = (2, d_in, d_out // 2) if layout == "in_out" else (2, d_out // 2, d_in)
    weights = tuple(jax.random.normal(k, shape, jnp.bfloat16) * 0.02 for k in keys[:n])
    x = jax.random.normal(keys[n], (x_rows, d_in), jnp.bfloat16)
    res = jax.random.normal(keys[n + 1], (rows, d_out // 2 if after and after.startswith("silu") else d_out),
                            jnp.bfloat16)
    fn = program(layout, after, splits)(x, res, weights).compile(
        compiler_options={**DOT_MERGER_OFF, **parse_xla_options(xla_options)})
    wall = time_fn(lambda: fn(x, res, weights), warmup=3, iters=10)["median_ms"] * 1e3 / n
    trace_dir = tempfile.mkdtemp()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            jax.block_until_ready(fn(x, res, weights))
    events = kernel_events(trace_dir)
    per_kernel: dict[str, float] = {}
    for e in events:
        per_kernel[str(e.get("name", ""))[:60]] = per_kernel.get(str(e.get("name", ""))[:60], 0.0) + float(e["dur"])
    us = sum(per_kernel.values()) / calls / n
    flop = 2 * rows * d_in * d_out
    del weights
    return {"product": name, "rows": rows, "layout": layout, "splits": splits, "xla_options": xla_options,
            "us": round(us, 2),
            "wall_us": round(wall, 2),
            "kernels": round(len(events) / calls / n, 2), "tflops": round(flop / us / 1e6, 1),
            "by_kernel_us": {k: round(v / calls / n, 2) for k, v in sorted(per_kernel.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[272])
    ap.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
    ap.add_argument("--layouts", nargs="+", default=["in_out", "out_in"], choices=["in_out", "out_in"])
    ap.add_argument("--splits", type=int, nargs="+", default=[1],
                    help="K slices (>1: float32 partials out, the op after the product left out)")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--calls", type=int, default=5)
    add_xla_options_argument(ap)
    ap.add_argument("--out")
    args = ap.parse_args()
    results = []
    print("| product | rows | layout | splits | XLA options | kernel us | wall us | kernels | TFLOP/s | kernels, us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.products:
        for rows in args.rows:
            for layout in args.layouts:
                for splits, xla in itertools.product(args.splits, args.xla_options):
                    if splits > 1 and PRODUCTS[name][2] is not None:
                        continue  # split partials end at the product
                    if (PRODUCTS[name][2] or "").startswith("silu-kernel") and layout != "out_in":
                        continue  # the kernel takes its weights [2, mlp, in] only
                    r = measure(name, rows, layout, args.layers, args.calls, splits, xla)
                    results.append(r)
                    kernels = "; ".join(f"{k} {v}" for k, v in list(r["by_kernel_us"].items())[:3])
                    print(f"| {name} | {rows} | {layout} | {splits} | {xla or '-'} | {r['us']} | {r['wall_us']} | "
                          f"{r['kernels']} | {r['tflops']} | {kernels} |", flush=True)
    log("done")
    write_json(args.out, {"env": environment(), "rows": results})


if __name__ == "__main__":
    main()
