"""The drafter's products with int8 weights against bf16 ones, at the rows a drafter pass has.

A drafter pass multiplies 16 rows (15 for the LM head) by every weight it has: at the Qwen3-8B
shape 3.3 GB a DDTree round, read at the memory's pace. Stored as int8 with one float32 scale
per output column, a weight is half the bytes; whether that halves the product's time depends
on XLA fusing the int8 -> bf16 conversion into the GEMM (otherwise it writes the bf16 weight out
first). Per product: 5 distinct weights (as 5 layers; the LM head once) in one program, the GPU
kernel time per weight and the wall time, bf16 against int8, compile excluded.

    python -m dflash_jax.bench.int8_products --out int8_products.json
"""
from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.common import environment, log, write_json
from dflash_jax.bench.profile import kernel_us

# name: (einsum, x shape, weight shape, contracted leading axes of the weight, copies)
PRODUCTS = {
    "q": ("bse,ehd->bshd", (1, 16, 4096), (4096, 32, 128), 1, 5),
    "kv": ("bne,ekgd->bnkgd", (1, 16, 4096), (4096, 8, 2, 128), 1, 5),
    "o": ("bshd,hde->bse", (1, 16, 32, 128), (32, 128, 4096), 2, 5),
    "gate_up": ("bse,etm->bstm", (1, 16, 4096), (4096, 2, 12288), 1, 5),
    "down": ("bsm,me->bse", (1, 16, 12288), (12288, 4096), 1, 5),
    "fc": ("bnt,te->bne", (1, 16, 20480), (20480, 4096), 1, 1),
    "lm_head": ("...e,ev->...v", (1, 15, 4096), (4096, 151936), 1, 1),
}


def quantize(w: jax.Array, contracted: int) -> tuple[jax.Array, jax.Array]:
    """w -> (int8 values, float32 scale over w's output axes): w ~ values * scale."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=tuple(range(contracted)))
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    return jnp.clip(jnp.round(w.astype(jnp.float32) / scale), -127, 127).astype(jnp.int8), scale


def bench(name: str) -> dict[str, Any]:
    eq, xs, ws, contracted, copies = PRODUCTS[name]
    keys = jax.random.split(jax.random.key(0), copies + 1)
    x = jax.random.normal(keys[0], xs, jnp.bfloat16)
    weights = [(jax.random.normal(k, ws, jnp.float32) * ws[0] ** -0.5).astype(jnp.bfloat16) for k in keys[1:]]
    quantized = [quantize(w, contracted) for w in weights]

    @jax.jit
    def bf16(x, ws):
        return sum(jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(x.dtype) for w in ws)

    @jax.jit
    def int8(x, qs):
        return sum((jnp.einsum(eq, x, v.astype(x.dtype), preferred_element_type=jnp.float32) * s).astype(x.dtype)
                   for v, s in qs)

    row: dict[str, Any] = {"product": name, "rows": xs[1], "weight": list(ws), "copies": copies,
                           "weight_mb_bf16": round(2 * jnp.size(weights[0]) / 1e6, 1)}
    for label, fn, arg in (("bf16", bf16, weights), ("int8", int8, quantized)):
        jax.block_until_ready(fn(x, arg))
        kern, wall = kernel_us(lambda fn=fn, arg=arg: fn(x, arg), copies)
        row[f"{label}_kernel_us"], row[f"{label}_wall_us"] = round(kern, 2), round(wall, 2)
        row[f"{label}_tb_s"] = round(row["weight_mb_bf16"] / (1 if label == "bf16" else 2) / max(kern, 1e-9), 2)
    ref = bf16(x, [(v.astype(jnp.float32) * s).astype(jnp.bfloat16) for v, s in quantized])
    row["max_abs_diff_vs_dequantized"] = float(jnp.max(jnp.abs(int8(x, quantized).astype(jnp.float32)
                                                               - ref.astype(jnp.float32))))
    log(row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--products", nargs="+", choices=sorted(PRODUCTS), default=list(PRODUCTS))
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    rows = [bench(name) for name in args.products]
    print(f"\n{env['device']}, jax {env['jax']}: per weight, GPU kernel us (TB/s of weight bytes)")
    print("| product | rows | bf16 weight MB | bf16 us | int8 us | bf16 / int8 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['product']} | {r['rows']} | {r['weight_mb_bf16']} | {r['bf16_kernel_us']} ({r['bf16_tb_s']}) | "
              f"{r['int8_kernel_us']} ({r['int8_tb_s']}) | {r['bf16_kernel_us'] / max(r['int8_kernel_us'], 1e-9):.2f} |")
    write_json(args.out, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
