"""The all-reduce behind tensor parallelism, alone: device time per op by rows, width and dtype.

    python -m dflash_jax.bench.collectives --rows 1 80 272 --hidden 4096 5120 \\
        --dtypes float32 bfloat16 --variants nccl LL Simple nccl-sync one-shot --out collectives.json
    python -m dflash_jax.bench.collectives --tiny      (CPU smoke test with 2 fake devices)

Under tp each transformer layer all-reduces two [rows, hidden] activations (after o_proj and
down_proj), so a round's collective time is about 2 x layers x the time of one such op. Here
`--chain` all-reduces run back to back inside one jitted shard_map program, each input depending
on the previous output so XLA neither overlaps nor combines them; the same program without the
psums is timed too and subtracted. Each `--variants` entry runs in its own subprocess (NCCL and
XLA read their environment once):
  nccl           NCCL as configured;
  LL, LL128, Simple   NCCL with NCCL_PROTO set to that protocol;
  nccl-sync      NCCL, with the all-reduces on the compute stream (not async start/done pairs);
  one-shot       XLA's own all-reduce kernel (`--xla_gpu_unsupported_use_all_reduce_one_shot_kernel`)
                 for the inputs it supports (up to 256 KB one-shot, 2 MB two-shot; larger ones stay
                 on NCCL). It reads the peers' buffers over NVLink; XLA emits it without multimem.
  one-shot-split one-shot with XLA's all-reduce combiner off (for tensor_parallel's chunked all-reduces);
  nccl-graph     NCCL, with the collectives recorded into XLA's CUDA graphs (command buffers);
  nccl-no-graph  NCCL, with XLA's CUDA graphs off;
  nccl-symmetric NCCL on buffers XLA places in NCCL-registered symmetric memory windows, where
                 NCCL has low-latency kernels that read and write the peer's window directly;
  nccl-user-buffers  NCCL on buffers registered with NCCL (zero-copy for peer-to-peer transfers).
The last two need a collective memory arena (`COLLECTIVE_ARENA_ENV`, set before jax starts).
Measured on H200s (BENCHMARKS.md): neither changed the all-reduce or the tp round,
and NCCL's log showed no window registration, so the symmetric kernels likely never ran.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0) in all of them: with it off NCCL creates no
multicast object, also for symmetric windows (it uses multimem kernels only with NVLS support).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterable, MutableMapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from dflash_jax.bench.common import environment, time_fn, write_json

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
# How the all-reduces run, as XLA compiler options (tensor_parallel --all-reduce passes them per
# program; here they become XLA_FLAGS of a subprocess). "nccl-sync": NCCL all-reduces issued on
# the compute stream instead of as async start/done pairs on a collective stream (whose
# stream-to-stream syncs may be part of the ~20 us per op). "one-shot": XLA's own kernel.
# XLA:GPU records runs of kernels into CUDA graphs ("command buffers"). Its default command
# types are these; collectives are not among them, so every all-reduce ends one graph and starts
# the next. "nccl-graph" records the NCCL all-reduces into the graphs too; "nccl-no-graph" turns
# graphs off. Both test whether the ~23 us floor per all-reduce (BENCHMARKS.md) is launch cost.
COMMAND_BUFFER_DEFAULT = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")
ALL_REDUCE = {"nccl": None, "nccl-sync": {"xla_gpu_disable_async_collectives": "ALLREDUCE"},
              "one-shot": {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True},
              "one-shot-split": {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True,
                                 "xla_gpu_all_reduce_combine_threshold_bytes": 0},
              "nccl-graph": {"xla_gpu_enable_command_buffer": ",".join(COMMAND_BUFFER_DEFAULT + ("COLLECTIVES",))},
              "nccl-no-graph": {"xla_gpu_enable_command_buffer": ""},
              "nccl-overlap": {"xla_gpu_enable_latency_hiding_scheduler": True,
                               "xla_gpu_all_reduce_combine_threshold_bytes": 0},
              "nccl-symmetric": {"xla_gpu_experimental_enable_nccl_symmetric_buffers": True},
              "nccl-user-buffers": {"xla_gpu_enable_nccl_user_buffers": True}}
# Variants whose buffers live in collective memory, which the GPU client carves from an arena of
# this many MB, sized when jax starts (so the whole process gets it; other variants don't use it).
NEEDS_COLLECTIVE_ARENA = ("nccl-symmetric", "nccl-user-buffers")
COLLECTIVE_ARENA_ENV = {"XLA_PYTHON_CLIENT_COLLECTIVE_MEM_SIZE_MB": "1024"}


def add_collective_arena(env: MutableMapping[str, str], variants: Iterable[str]) -> None:
    """Sizes the collective memory arena in `env` (unless it already says) when a variant needs it."""
    if any(v in NEEDS_COLLECTIVE_ARENA for v in variants):
        for key, value in COLLECTIVE_ARENA_ENV.items():
            env.setdefault(key, value)
# "one-shot-split" also traces the model under `sharding.all_reduce_max_bytes(2 MiB)`: row-parallel
# results over XLA's 2 MB kernel limit are all-reduced in row chunks that fit it (and the
# combiner, which would join the chunks again, is off). Here, one op at a time, it equals one-shot.
ALL_REDUCE_MAX_BYTES = {"one-shot-split": 2 * 2 ** 20}
# "nccl-overlap" also traces the model under `sharding.overlap_row_groups(2)`: each layer's work
# after attention in two row groups, whose all-reduces the latency-hiding scheduler may overlap
# with the other group's products (the combiner, which would join them, is off).
ROW_GROUPS = {"nccl-overlap": 2}
NCCL_PROTOS = ("LL", "LL128", "Simple")


def xla_flags(options: dict[str, object]) -> list[str]:
    """Compiler options as XLA_FLAGS entries: {"a": True} -> ["--a=true"]."""
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in options.items()]


def chain_ms(mesh, rows: int, hidden: int, dtype, chain: int, communicate: bool) -> float:
    """Median ms of `chain` dependent all-reduces of a [rows, hidden] array on every device."""
    tp = mesh.devices.size

    def body(x):
        for _ in range(chain):
            y = jax.lax.psum(x, "tp") if communicate else x * 2
            x = y * jnp.asarray(0.5, dtype)  # keeps values finite and makes the next op depend on this one
        return x

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = jax.device_put(jnp.ones((tp * rows, hidden), dtype), NamedSharding(mesh, P("tp")))
    return time_fn(lambda: fn(x), warmup=3, iters=20)["median_ms"]


def measure(rows: list[int], hidden: list[int], dtypes: list[str], chain: int) -> list[dict]:
    mesh = jax.make_mesh((len(jax.devices()),), ("tp",))
    out = []
    for h in hidden:
        for r in rows:
            for name in dtypes:
                dt = DTYPES[name]
                with_ops = chain_ms(mesh, r, h, dt, chain, True)
                without = chain_ms(mesh, r, h, dt, chain, False)
                us = max(0.0, with_ops - without) / chain * 1e3
                nbytes = r * h * jnp.dtype(dt).itemsize
                row = {"rows": r, "hidden": h, "dtype": name, "bytes": nbytes, "us_per_allreduce": us,
                       "algo_gb_s": nbytes / (us * 1e-6) / 1e9 if us > 0 else None}
                print(row, flush=True)
                out.append(row)
    return out


def variant_env(variant: str) -> dict[str, str]:
    """The environment of one `--variants` entry's subprocess."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    env.pop("NCCL_PROTO", None)
    if variant in NCCL_PROTOS:
        env["NCCL_PROTO"] = variant
    elif variant in ALL_REDUCE:
        env["XLA_FLAGS"] = " ".join(filter(None, [env.get("XLA_FLAGS"), *xla_flags(ALL_REDUCE[variant] or {})]))
        add_collective_arena(env, [variant])
    else:
        raise ValueError(f"--variants: unknown variant {variant!r} "
                         f"({', '.join([*ALL_REDUCE, *NCCL_PROTOS])})")
    return env


def run_variant(args, variant: str) -> dict:
    """`measure` in a subprocess with the variant's environment."""
    env = variant_env(variant)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "dflash_jax.bench.collectives", "--child", "--chain", str(args.chain),
           "--rows", *map(str, args.rows), "--hidden", *map(str, args.hidden), "--dtypes", *args.dtypes]
    if args.tiny:
        cmd.append("--tiny")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.variant_timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.variant_timeout} s"}
    lines = [l for l in res.stdout.splitlines() if l.startswith("ROWS ")]
    if res.returncode or not lines:
        return {"variant": variant, "error": (res.stderr or res.stdout)[-2000:]}
    return {"variant": variant, "rows": json.loads(lines[-1][len("ROWS "):])}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 80, 272])
    ap.add_argument("--hidden", nargs="+", type=int, default=[4096, 5120])
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    ap.add_argument("--chain", type=int, default=64, help="dependent all-reduces per timed program")
    ap.add_argument("--variants", nargs="+", default=["nccl"],
                    help="one subprocess each: nccl, nccl-sync, one-shot, or an NCCL_PROTO (LL, LL128, Simple)")
    ap.add_argument("--variant-timeout", type=float, default=300)
    ap.add_argument("--tiny", action="store_true", help="2 fake CPU devices, small shapes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    # The parent and each child hold the GPUs at once: neither may grab most of their memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.tiny:
        jax.config.update("jax_num_cpu_devices", 2)
        args.rows, args.hidden, args.chain = [1, 4], [64], 4
    if args.child:
        print("ROWS " + json.dumps(measure(args.rows, args.hidden, args.dtypes, args.chain)), flush=True)
        return
    if len(jax.devices()) < 2:
        raise SystemExit(f"collectives: needs at least 2 devices, found {len(jax.devices())}")
    env = environment()
    print(env, flush=True)
    for v in args.variants:
        variant_env(v)  # an unknown name fails before anything runs
    results = [run_variant(args, v) for v in args.variants]
    write_json(args.out, {"env": env, "chain": args.chain, "results": results})
    print(f"\n{env['device']} x{env['num_devices']}, jax {env['jax']}; microseconds per all-reduce "
          f"(chains of {args.chain})")
    print("| variant | rows | hidden | dtype | MB | us | GB/s |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        if "error" in res:
            print(f"| {res['variant']} | error: {res['error'][-200:]!r} |")
            continue
        for r in res["rows"]:
            gbs = "-" if r["algo_gb_s"] is None else f"{r['algo_gb_s']:.0f}"
            print(f"| {res['variant']} | {r['rows']} | {r['hidden']} | {r['dtype']} | {r['bytes'] / 1e6:.3f} "
                  f"| {r['us_per_allreduce']:.1f} | {gbs} |")


if __name__ == "__main__":
    main()
