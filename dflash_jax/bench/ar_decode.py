"""AR decode ms/token at batch 1 against the HBM roofline (issue: foundation, GPU measurement).

python -m dflash_jax.bench.ar_decode --models qwen3-8b smollm2-135m --contexts 1024 8192 --out ar.json

Weights are random bf16 of each model's shape. Each timed call runs `steps` decode steps
(one `lax.fori_loop`, compile excluded) from a cache already holding `ctx` tokens; the
ms/token is the median call time / steps. The roofline is (weight bytes [+ KV bytes read])
over the device copy bandwidth measured in the same run.

A Qwen3.5 / Qwen3.6 hybrid shape (qwen3.6-27b, tiny-hybrid) decodes with `qwen3_5.forward`, its
attention layers' core by --impls as a dense target's; its cache bytes per token are
the attention layers' K/V read plus each Gated-DeltaNet layer's float32 recurrent state, read and
written back every step.

    python -m dflash_jax.bench.ar_decode --models tiny-hybrid --contexts 64 --steps 4 --copy-gb 0.01
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.common import SHAPES, copy_bandwidth, dump_hlo, environment, log, time_fn, write_json
from dflash_jax import qwen3_5
from dflash_jax.bench.profile import profile_program, scale_profile
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import forward, init_params
from dflash_jax.params import param_bytes
from dflash_jax.qwen3_5 import HybridCache, Qwen35Config


def layer_buffers(key: jax.Array, shape: tuple[int, ...], n: int, dtype) -> tuple[tuple, tuple]:
    """(k, v): n distinct [shape] buffers each, from ONE random draw.

    Timing does not depend on the values, and one draw keeps this cheap to compile under jit
    (the tensor-parallel benchmark builds caches inside a sharded jit): a program with one
    random draw per layer took minutes to compile on the GPU.
    """
    base = jax.random.normal(key, shape, dtype)
    scales = [jnp.asarray(1.0 + 0.01 * i, dtype) for i in range(2 * n)]
    k = tuple(base * scales[i] for i in range(n))
    v = tuple(-base * scales[n + i] for i in range(n))
    return k, v


def random_cache(cfg, batch: int, max_len: int, ctx: int, dtype) -> KVCache:
    """A KV cache of random values, `ctx` tokens committed. [batch, max_len, kv_heads, head_dim] per layer."""
    k, v = layer_buffers(jax.random.key(1), (batch, max_len, cfg.num_kv_heads, cfg.head_dim), cfg.num_layers, dtype)
    return KVCache(k=k, v=v, lengths=jnp.full((batch,), ctx, jnp.int32))


def random_hybrid_cache(cfg: Qwen35Config, batch: int, max_len: int, ctx: int, dtype) -> HybridCache:
    """A hybrid's cache, `ctx` tokens committed: random K/V in the attention layers, zero conv and
    recurrent states (a step reads and writes them whole whatever their values)."""
    n_attn = len(cfg.attn_layers)
    k, v = layer_buffers(jax.random.key(1), (batch, max_len, cfg.num_kv_heads, cfg.head_dim), n_attn, dtype)
    empty = HybridCache.create(cfg, batch, 1, dtype)
    return HybridCache(k=tuple(k), v=tuple(v), conv=empty.conv, state=empty.state,
                       lengths=jnp.full((batch,), ctx, jnp.int32))


def cache_bytes_per_token(cfg, ctx: int, steps: int) -> int:
    """Cache bytes one bf16 decode step moves, averaged over `steps` steps from `ctx` tokens: the
    K/V read, and for a hybrid also each GDN layer's float32 state read and written."""
    if isinstance(cfg, Qwen35Config):
        kv = 2 * len(cfg.attn_layers) * (ctx + steps // 2) * cfg.num_kv_heads * cfg.head_dim * 2
        state = len(cfg.gdn_layers) * cfg.gdn_value_heads * cfg.gdn_key_dim * cfg.gdn_value_dim * 4
        return kv + 2 * state
    return 2 * cfg.num_layers * (ctx + steps // 2) * cfg.num_kv_heads * cfg.head_dim * 2


def make_decoder(cfg, steps: int, attn_impl: str):
    hybrid = isinstance(cfg, Qwen35Config)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def run(params, cache, token):
        def body(_, carry):
            cache, tok = carry
            if hybrid:
                out = qwen3_5.forward(params, cfg, tok[:, None], cache.lengths[:, None], cache, attn_impl=attn_impl)
            else:
                out = forward(params, cfg, tok[:, None], cache.lengths[:, None], cache, None, attn_impl=attn_impl)
            nxt = jnp.argmax(out.logits[:, 0], -1).astype(jnp.int32)
            return dataclasses.replace(out.cache, lengths=cache.lengths + 1), nxt
        cache, tok = jax.lax.fori_loop(0, steps, body, (cache, token))
        return dataclasses.replace(cache, lengths=cache.lengths - steps), tok
    return run


# XLA compiler options to compare. M = 1 GEMMs go to XLA's Triton GEMM fusions by default (the
# gate/up GEMVs stream at 2.4 TB/s on the H200); "cublas" sends them to cuBLAS instead.
GEMM_OPTIONS = {"default": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def bench_model(name: str, contexts: list[int], steps: int, impls: list[str], bandwidth: float,
                on_row=lambda rows: None, profile: bool = False, hlo_dir: str | None = None,
                gemms: tuple[str, ...] = ("default",)) -> list[dict]:
    cfg = SHAPES[name]
    hybrid = isinstance(cfg, Qwen35Config)
    init = qwen3_5.init_params if hybrid else init_params
    params = jax.block_until_ready(init(cfg, jax.random.key(0), jnp.bfloat16))
    log(f"{name}: weights drawn")
    wbytes = param_bytes(params)
    rows = []
    # One max_len for every context: the context is a runtime length, so one compile per impl.
    max_len = max(contexts) + steps + 64
    variants = [(impl, gemm) for impl in impls for gemm in gemms]
    runs: dict[tuple[str, str], Any] = {}
    compile_s: dict[tuple[str, str], float] = {}
    for ctx in contexts:
        kv_bytes = cache_bytes_per_token(cfg, ctx, steps)
        for impl, gemm in variants:
            cache = (random_hybrid_cache if hybrid else random_cache)(cfg, 1, max_len, ctx, jnp.bfloat16)
            tok = jnp.zeros((1,), jnp.int32) + 7
            if (impl, gemm) not in runs:  # compile once, ahead of time, for every context
                t0 = time.perf_counter()
                runs[impl, gemm] = make_decoder(cfg, steps, impl).lower(params, cache, tok).compile(
                    compiler_options=GEMM_OPTIONS[gemm])
                compile_s[impl, gemm] = time.perf_counter() - t0
                log(f"{name} {impl} gemm={gemm}: compiled in {compile_s[impl, gemm]:.1f} s")
                dump_hlo(hlo_dir, f"ar_{name}_{impl}_{gemm}", runs[impl, gemm].as_text())
            run = runs[impl, gemm]
            state = {"cache": cache}

            def call():
                state["cache"], t = run(params, state["cache"], tok)
                return t
            t = time_fn(call, warmup=2, iters=10)
            ms = t["median_ms"] / steps
            where = None
            if profile:
                where = scale_profile(profile_program(call, run.as_text(), calls=3), steps)  # per token
            floor_w = wbytes / bandwidth * 1e3
            floor_wkv = (wbytes + kv_bytes) / bandwidth * 1e3
            rows.append({"model": name, "ctx": ctx, "attn": impl, "gemm": gemm, "ms_per_token": ms,
                         "weight_gb": wbytes / 1e9, "kv_gb_read": kv_bytes / 1e9,
                         "roofline_weights_ms": floor_w, "roofline_weights_kv_ms": floor_wkv,
                         "pct_of_weight_roofline": 100 * floor_w / ms,
                         "pct_of_weight_kv_roofline": 100 * floor_wkv / ms,
                         "compile_s": compile_s[impl, gemm], "profile_per_token": where})
            log(rows[-1])
            on_row(rows)
            del cache, state
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-8b", "smollm2-135m"], choices=sorted(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--impls", nargs="+", default=["pallas", "reference"])
    ap.add_argument("--gemm", nargs="+", choices=sorted(GEMM_OPTIONS), default=["default"],
                    help="XLA GEMM backend options to compare side by side")
    ap.add_argument("--copy-gb", type=float, default=4.0)
    ap.add_argument("--profile", action="store_true", help="split each step's device time by kind of work")
    ap.add_argument("--dump-hlo", metavar="DIR", help="write each compiled decoder's HLO here (gzip)")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    bw = copy_bandwidth(int(args.copy_gb * (1 << 30)))
    log(env, bw)
    rows = []
    for m in args.models:
        # Written after every row, so a run stopped at its time limit still reports what it measured.
        done = list(rows)
        rows += bench_model(m, args.contexts, args.steps, args.impls, bw["tb_per_s"] * 1e12,
                            on_row=lambda new: write_json(args.out, {"env": env, "copy_bandwidth": bw,
                                                                     "rows": done + new}),
                            profile=args.profile, hlo_dir=args.dump_hlo, gemms=tuple(args.gemm))
    write_json(args.out, {"env": env, "copy_bandwidth": bw, "rows": rows})
    print(f"\ncopy bandwidth {bw['tb_per_s']:.2f} TB/s ({env['device']}, jax {env['jax']})")
    print("| model | ctx | attention | gemm | ms/token | weights GB | roofline (w) ms | % of (w) "
          "| roofline (w+kv) ms | % of (w+kv) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['ctx']} | {r['attn']} | {r['gemm']} | {r['ms_per_token']:.3f} | "
              f"{r['weight_gb']:.2f} | {r['roofline_weights_ms']:.3f} | {r['pct_of_weight_roofline']:.0f}% | "
              f"{r['roofline_weights_kv_ms']:.3f} | {r['pct_of_weight_kv_roofline']:.0f}% |")


if __name__ == "__main__":
    main()
