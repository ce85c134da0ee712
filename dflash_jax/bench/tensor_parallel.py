"""Tensor parallelism: AR ms/token and DDTree round latency at tp=1 and tp=2, in one command.

GPU (2 x H200; the issue's measurement):
    python -m dflash_jax.bench.tensor_parallel --models qwen3-8b qwen3-32b --tps 1 2 \\
        --ctx 4096 --budgets 64 256 --memory-ctx 32768 --out tp.json
CPU smoke test (tiny shapes, fake CPU devices; checks the script runs, measures nothing):
    python -m dflash_jax.bench.tensor_parallel --tiny

Random bf16 weights of each shape, drawn straight into their shards. For every model and tp
(a ("dp", "tp") = (1, tp) mesh over the first tp devices), in the same process:
  * AR: ms/token of `--steps` greedy decode steps in one jitted `fori_loop`, from a cache
    holding `--ctx` tokens;
  * DDTree: the median latency of one fused round (`speculative.spec_round`) per budget at
    `--ctx`, with a 5-layer drafter of the target's width (the shape of z-lab's drafters),
    compiled as DDTree decoding compiles it (XLA's dot merger off);
  * at tp > 1, once per `--all-reduce` variant (`bench.collectives.ALL_REDUCE`: NCCL, NCCL on
    the compute stream, XLA's one-shot kernel, chunked, in CUDA graphs, overlapped with row
    groups, or on NCCL symmetric-memory / registered buffers), as compiler options
    of the same programs, so the weights and caches are shared;
  * collectives: every collective in the compiled step / round (from its HLO) is replayed
    alone, in order and with the same shapes, as a `shard_map` program; its time over the
    step's time is the collective share. With `--profile`, the share is also read from a
    profiler trace (device events whose name looks like a collective / all device events), and
    each round's kernel time per GPU is split by stage (draft, tree, verify, accept, commit).
Then, in a fresh subprocess (so the peak is its own), peak memory per device of the target +
drafter + a `--memory-ctx`-token target and drafter cache through one DDTree round at the
largest budget, at the largest tp (from `device.memory_stats()`; absent on CPU).
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import re
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax import drafter as dr
from dflash_jax import sharding as sh
from dflash_jax.bench.ar_decode import make_decoder, random_cache
from dflash_jax.bench.collectives import ALL_REDUCE, ALL_REDUCE_MAX_BYTES, ROW_GROUPS, add_collective_arena
from dflash_jax.bench.common import SHAPES, dense_shape, environment, time_fn, write_json
from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.stage_times import STAGES
from dflash_jax.model import forward, init_params
from dflash_jax.params import param_bytes
from dflash_jax.bench.profile import profile_program, scale_profile
from dflash_jax.bench.spec_round import ROUNDS_PER_CALL, drafter_config, make_state, round_program, timed_rounds
from dflash_jax.speculative import SPEC_PROFILED_OPTIONS, SpecSettings, spec_round

TINY = ModelConfig(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=6,
                   num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True, rope=RopeConfig(theta=1e6))
GB = 1e9


# ----------------------------------------------------------------------------- setup

def sharded_jit_init(fn, mesh, *args):
    """Runs `fn(*args)` (which makes a pytree of arrays) straight into `sh.state_shardings`."""
    shapes = jax.eval_shape(fn, *args)
    return jax.jit(fn, out_shardings=sh.state_shardings(shapes, mesh))(*args)


def make_models(cfg: ModelConfig, dcfg: dr.DraftConfig, mesh, dtype) -> tuple[Any, Any]:
    """The target and the drafter in their decoding layouts at the mesh's tp, drawn into their shards."""
    target = init_params(cfg, jax.random.key(0), dtype, mesh=mesh)
    dparams = dr.init_draft_params(dcfg, jax.random.key(1), dtype, mesh=mesh)
    return target, dparams


def make_spec_state(cfg, dcfg, ctx: int, max_len: int, max_new: int, dtype, mesh):
    """A SpecState with `ctx` committed tokens (random K/V), created already sharded."""
    del dtype  # make_state uses bf16
    return sharded_jit_init(lambda: make_state(cfg, dcfg, ctx, max_len, max_new), mesh)


# ----------------------------------------------------------------------------- collectives

_COLLECTIVE = re.compile(r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|bf16|f16|f32|f64)\[([0-9,]*)\]")
_DTYPES = {"pred": jnp.bool_, "s8": jnp.int8, "u8": jnp.uint8, "s16": jnp.int16, "u16": jnp.uint16,
           "s32": jnp.int32, "u32": jnp.uint32, "s64": jnp.int64, "bf16": jnp.bfloat16, "f16": jnp.float16,
           "f32": jnp.float32, "f64": jnp.float64}


def hlo_collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """[(kind, dtype, result shape)] of every collective in compiled HLO text, in text order.

    Collectives inside loop bodies are listed once (the AR decoder is compiled one step at a
    time for this reason); a tuple-shaped (combined) collective lists each of its arrays.
    """
    out = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        for dtype, dims in _ARRAY.findall(m.group(1)):
            out.append((m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def replay_collectives(ops: list[tuple[str, str, tuple[int, ...]]], mesh,
                       compiler_options: dict[str, Any] | None = None) -> float | None:
    """Median ms of the same collectives, run alone and one after another on `mesh`'s tp axis.

    all-reduce -> psum of the same shape; all-gather -> all_gather to the same result size;
    anything else -> psum of its result size (an overestimate). Each op's input depends on the
    previous op's output, so XLA neither overlaps nor combines them. The time of the same
    program without the collectives is subtracted (one dispatch, the glue ops). The replay is
    compiled with the measured program's `compiler_options` (which may pick the all-reduce kernel).
    """
    tp = sh.mesh_sizes(mesh)[1]
    if not ops or tp == 1:
        return None
    leaves = []
    for kind, dtype, shape in ops:
        dt = jnp.float32 if dtype == "pred" else _DTYPES[dtype]  # psum has no bool form
        n = max(1, math.prod(shape))
        if kind == "all-gather":
            leaves.append(("g", jnp.zeros((tp, -(-n // tp)), dt)))
        else:
            leaves.append(("r", jnp.zeros((tp, n), dt)))

    def body(*xs, communicate: bool):
        carry = jnp.zeros((), jnp.float32)
        outs = []
        for (kind, _), x in zip(leaves, xs):
            x = x + carry.astype(x.dtype)  # data dependency on the previous collective
            if not communicate:
                y = x
            elif kind == "g":
                y = jax.lax.all_gather(x, sh.TP, tiled=True)
            else:
                y = jax.lax.psum(x, sh.TP)
            carry = y.reshape(-1)[0].astype(jnp.float32) * 0
            outs.append(carry)
        return jnp.stack(outs)[None]

    arrays = [jax.device_put(x, NamedSharding(mesh, P(sh.TP))) for _, x in leaves]
    times = []
    # The same program without the collectives: its time (dispatch, the chain of tiny adds) is
    # subtracted.
    for communicate in (True, False):
        fn = jax.jit(jax.shard_map(functools.partial(body, communicate=communicate), mesh=mesh,
                                   in_specs=tuple(P(sh.TP) for _ in arrays), out_specs=P(sh.TP),
                                   check_vma=False), compiler_options=compiler_options)
        times.append(time_fn(lambda: fn(*arrays), warmup=3, iters=20)["median_ms"])
    return max(0.0, times[0] - times[1])


# ----------------------------------------------------------------------------- measurements

def bench_ar(target, cfg, mesh, ctx: int, steps: int, max_len: int,
             compiler_options: dict[str, Any] | None = None) -> dict:
    cache = sharded_jit_init(lambda: random_cache(cfg, 1, max_len, ctx, jnp.bfloat16), mesh)
    tok = jax.device_put(jnp.full((1,), 7, jnp.int32), NamedSharding(mesh, P()))
    run = make_decoder(cfg, steps, "auto").lower(target, cache, tok).compile(compiler_options=compiler_options)
    box = {"cache": cache}

    def call():
        box["cache"], t = run(target, box["cache"], tok)
        return t
    ms = time_fn(call, warmup=2, iters=10)["median_ms"] / steps

    def one_step(params, cache, tok):
        out = forward(params, cfg, tok[:, None], cache.lengths[:, None], cache, None)
        return out.cache, jnp.argmax(out.logits[:, 0], -1)
    hlo = jax.jit(one_step).lower(target, box["cache"], tok).compile(compiler_options=compiler_options).as_text()
    ops = hlo_collectives(hlo)
    comm = replay_collectives(ops, mesh, compiler_options)
    return {"ms_per_token": ms, "collectives_per_step": len(ops), "collective_ms": comm,
            "collective_share": None if comm is None else comm / ms}


def bench_round(target, dparams, cfg, dcfg, mesh, budget: int, ctx: int, max_len: int, profile_dir: str | None,
                compiler_options: dict[str, Any] | None = None) -> dict:
    s = SpecSettings(method="ddtree", block_size=dcfg.block_size, budget=budget, max_new_tokens=512)
    state = make_spec_state(cfg, dcfg, ctx, max_len, s.max_new_tokens, jnp.bfloat16, mesh)
    # As DDTree decoding compiles it (dot merger off), command buffers off so that a profile can
    # attribute kernels, plus the variant's options.
    options = {**SPEC_PROFILED_OPTIONS, **(compiler_options or {})}
    ms, rnd, call = timed_rounds(target, dparams, cfg, dcfg, s, state, options)
    hlo = rnd.as_text()
    ops = hlo_collectives(hlo)
    comm = replay_collectives(ops, mesh, options)
    row = {"budget": budget, "width": s.width, "round_ms": ms, "collectives_per_round": len(ops),
           "collective_ms": comm, "collective_share": None if comm is None else comm / ms}
    if profile_dir:
        prof = scale_profile(profile_program(call, hlo, calls=3, scopes=STAGES, log_dir=profile_dir),
                             ROUNDS_PER_CALL)
        if "error" not in prof:  # the trace's own view: collective kernels over all device time
            prof["collective_share"] = prof["by_kind"].get("collective", 0.0) / prof["device_ms"]
        row["profile"] = prof
    return row


def memory_report(model: str, tp: int, ctx: int, budget: int, tiny: bool) -> dict:
    """Target + 5-layer drafter + ctx-token caches through one DDTree round; peak per device."""
    cfg = TINY if tiny else dense_shape(model, "tensor_parallel")
    dcfg = drafter_config(cfg, 2 if tiny else 5)
    mesh = sh.make_mesh(1, tp)
    with sh.use_mesh(mesh):
        target, dparams = make_models(cfg, dcfg, mesh, jnp.bfloat16)
        s = SpecSettings(method="ddtree", block_size=dcfg.block_size, budget=budget, max_new_tokens=512)
        max_len = ctx + s.cache_slack() + 64
        state = make_spec_state(cfg, dcfg, ctx - 64, max_len, s.max_new_tokens, jnp.bfloat16, mesh)
        rnd = jax.jit(functools.partial(spec_round, cfg=cfg, dcfg=dcfg, s=s), donate_argnums=(0,))
        for _ in range(2):
            state = rnd(state, target=target, dparams=dparams)
        jax.block_until_ready(state.count)
    cache_bytes = param_bytes(state.cache.k) + param_bytes(state.cache.v)
    dcache_bytes = param_bytes(state.draft_cache.k) + param_bytes(state.draft_cache.v)
    devices = []
    for d in mesh.devices.reshape(-1):
        stats = d.memory_stats() or {}
        devices.append({"device": str(d), "peak_gb": stats.get("peak_bytes_in_use", 0) / GB or None,
                        "in_use_gb": stats.get("bytes_in_use", 0) / GB or None,
                        "limit_gb": stats.get("bytes_limit", 0) / GB or None})
    peak = max((d["peak_gb"] or 0) for d in devices) or None
    return {"model": "tiny" if tiny else model, "tp": tp, "ctx": ctx, "budget": budget,
            "target_gb": param_bytes(target) / GB, "drafter_gb": param_bytes(dparams) / GB,
            "kv_cache_gb": cache_bytes / GB, "draft_cache_gb": dcache_bytes / GB,
            "per_device_static_gb": (param_bytes(target) + param_bytes(dparams) + cache_bytes + dcache_bytes)
            / GB / tp, "devices": devices, "max_peak_gb": peak,
            # A "48 GB" card has 48 GiB; leave room for the CUDA context and fragmentation.
            "fits_48gb": None if peak is None else peak * GB < 48 * 2 ** 30 - 2 * 2 ** 30}


def run_memory_subprocess(args, tp: int) -> dict:
    """memory_report in a fresh process, so the peak counts only that program."""
    cmd = [sys.executable, "-m", "dflash_jax.bench.tensor_parallel", "--memory-only", "--tps", str(tp),
           "--memory-model", args.memory_model, "--memory-ctx", str(args.memory_ctx),
           "--budgets", str(max(args.budgets))] + (["--tiny"] if args.tiny else [])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in res.stdout.splitlines() if l.startswith("MEMORY ")]
    if res.returncode or not lines:
        return {"error": (res.stderr or res.stdout)[-2000:], "returncode": res.returncode}
    return json.loads(lines[-1][len("MEMORY "):])


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-32b"], choices=sorted(SHAPES))
    ap.add_argument("--tps", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--budgets", nargs="+", type=int, default=[64, 256])
    ap.add_argument("--steps", type=int, default=32, help="AR decode steps per timed call")
    ap.add_argument("--memory-model", default="qwen3-32b", choices=sorted(SHAPES))
    ap.add_argument("--memory-ctx", type=int, default=32768)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--all-reduce", nargs="+", choices=sorted(ALL_REDUCE), default=["nccl"],
                    help="tp > 1 only: NCCL, NCCL on the compute stream (nccl-sync), XLA's one-shot "
                         "all-reduce kernel for small all-reduces, or that kernel with large row-parallel "
                         "results all-reduced in chunks that fit it (one-shot-split), or NCCL with each "
                         "layer's post-attention work in two overlappable row groups (nccl-overlap), or "
                         "NCCL on symmetric-memory or registered buffers (nccl-symmetric, nccl-user-buffers; "
                         "see bench.collectives). A variant after the first that fails is recorded, not fatal")
    ap.add_argument("--profile", help="directory for profiler traces (adds a trace-based collective share)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on fake CPU devices (a smoke test)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    add_collective_arena(os.environ, args.all_reduce)  # read when jax starts its GPU client, below
    if args.tiny:
        # Before any device is touched: enough fake CPU devices for the largest tp. Called in a
        # process where jax has already started (a test, a notebook), the devices it has must do.
        try:
            jax.config.update("jax_num_cpu_devices", max(args.tps))
        except RuntimeError:
            if len(jax.devices("cpu")) < max(args.tps):
                raise SystemExit(f"--tiny --tps {max(args.tps)}: jax started with "
                                 f"{len(jax.devices('cpu'))} CPU devices; run it in a fresh process")
        if not args.memory_only:
            args.ctx, args.budgets, args.steps, args.memory_ctx = 64, [8, 16], 4, 256
    if args.memory_only:
        print("MEMORY " + json.dumps(memory_report(args.memory_model, args.tps[0], args.memory_ctx,
                                                   max(args.budgets), args.tiny)), flush=True)
        return
    env = environment()
    print(env, flush=True)
    rows = []
    models = ["tiny"] if args.tiny else args.models
    for name in models:
        cfg = TINY if args.tiny else dense_shape(name, "tensor_parallel")
        dcfg = drafter_config(cfg, 2 if args.tiny else 5)
        max_len = args.ctx + 1024
        for tp in args.tps:
            sh.check_model(cfg, tp)
            mesh = sh.make_mesh(1, tp)
            with sh.use_mesh(mesh):
                target, dparams = make_models(cfg, dcfg, mesh, jnp.bfloat16)
                # Without collectives (tp = 1) the all-reduce variants are one program.
                for ar_impl in (args.all_reduce if tp > 1 else args.all_reduce[:1]):
                    options = ALL_REDUCE[ar_impl]
                    round_program.cache_clear()  # traced afresh under this variant's chunking
                    row = {"model": name, "tp": tp, "ctx": args.ctx, "all_reduce": ar_impl if tp > 1 else None,
                           "weights_gb_per_device": param_bytes(target) / GB / tp}
                    try:
                        with (sh.all_reduce_max_bytes(ALL_REDUCE_MAX_BYTES.get(ar_impl) if tp > 1 else None),
                              sh.overlap_row_groups(ROW_GROUPS.get(ar_impl, 1))):
                            row["ar"] = bench_ar(target, cfg, mesh, args.ctx, args.steps, max_len, options)
                            print(row, flush=True)
                            row["ddtree"] = []
                            for b in args.budgets:
                                row["ddtree"].append(bench_round(target, dparams, cfg, dcfg, mesh, b, args.ctx,
                                                                 max_len, args.profile, options))
                                print(row["ddtree"][-1], flush=True)
                    except Exception as e:  # noqa: BLE001 - an experimental variant may not compile or run
                        if tp == 1 or ar_impl == args.all_reduce[0]:
                            raise  # the baselines must work
                        row["error"] = f"{type(e).__name__}: {e}"[-2000:]
                        print({"all_reduce": ar_impl, "error": row["error"]}, flush=True)
                    rows.append(row)
                    write_json(args.out, {"env": env, "rows": rows})
            del target, dparams
            gc.collect()
    memory = None
    if not args.no_memory:
        memory = run_memory_subprocess(args, max(args.tps))
        print({"memory": memory}, flush=True)
    write_json(args.out, {"env": env, "rows": rows, "memory": memory})
    print_tables(env, rows, memory)


def print_tables(env: dict, rows: list[dict], memory: dict | None) -> None:
    f = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    print(f"\n{env['device']} x{env['num_devices']}, jax {env['jax']}, random bf16 weights, batch 1")
    print("| model | tp | all-reduce | what | ms | collective ms (replayed) | collective share | tp / tp=1 |")
    print("|---|---|---|---|---|---|---|---|")
    base = {}
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['tp']} | {r.get('all_reduce') or '-'} | failed: {r['error'][-200:]} "
                  "| - | - | - | - |")
            continue
        items = [("AR ms/token", r["ar"]["ms_per_token"], r["ar"])]
        items += [(f"DDTree round, budget {d['budget']}", d["round_ms"], d) for d in r["ddtree"]]
        for what, ms, d in items:
            key = (r["model"], what)
            if r["tp"] == 1:
                base[key] = ms
            ratio = ms / base[key] if key in base else None
            share = d.get("collective_share")
            print(f"| {r['model']} | {r['tp']} | {r.get('all_reduce') or '-'} | {what} (ctx {r['ctx']}) | "
                  f"{f(ms, '.3f')} | "
                  f"{f(d.get('collective_ms'), '.3f')} | {f(None if share is None else 100 * share, '.0f')}% | "
                  f"{f(ratio)} |")
    staged = [(r, d) for r in rows for d in r.get("ddtree", []) if (d.get("profile") or {}).get("by_scope")]
    if staged:
        # Which stages scale with tp (needs XLA_FLAGS=--xla_gpu_enable_command_buffer= to attribute
        # kernels). The trace holds every device's kernels: per GPU is the sum over tp.
        print("\n| model | tp | all-reduce | budget | kernel ms per GPU | " + " | ".join(STAGES)
              + " | other | of which collective |")
        print("|---|---|---|---|---|" + "---|" * (len(STAGES) + 2))
        for r, d in staged:
            prof, per = d["profile"], lambda x: None if x is None else x / r["tp"]  # noqa: E731
            cells = [f(per(prof["by_scope"].get(k))) for k in STAGES + ("other",)]
            print(f"| {r['model']} | {r['tp']} | {r.get('all_reduce') or '-'} | {d['budget']} | "
                  f"{f(per(prof['device_ms']))} | " + " | ".join(cells)
                  + f" | {f(per(prof['by_kind'].get('collective')))} |")
    if memory and "error" not in memory:
        print(f"\nmemory, {memory['model']} target + drafter + {memory['ctx']}-token caches, tp={memory['tp']}: "
              f"peak {f(memory['max_peak_gb'])} GB per device (static share {memory['per_device_static_gb']:.2f} "
              f"GB: target {memory['target_gb']:.2f} + drafter {memory['drafter_gb']:.2f} + caches "
              f"{memory['kv_cache_gb'] + memory['draft_cache_gb']:.2f} GB, over {memory['tp']}); "
              f"fits a 48 GB card: {memory['fits_48gb']}")
    elif memory:
        print(f"\nmemory measurement failed: {memory['error'][-500:]}")


if __name__ == "__main__":
    main()
