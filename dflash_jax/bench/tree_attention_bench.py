"""Benchmark of the tree-attention kernel against XLA masked attention and the jnp reference.

Shape: Qwen3-8B attention (32 q heads, 8 kv heads, head_dim 128), bfloat16, batch 1; a prefix of
``ctx`` committed tokens and ``W`` new tokens (W=1: AR decode; W>1: a random draft tree).

    python -m dflash_jax.bench.tree_attention_bench --out results.json        # H200, < 4 min
    python -m dflash_jax.bench.tree_attention_bench --quick --interpret       # CPU smoke test

Each timed program runs ``iters`` attention calls inside one jit (a fori_loop whose output feeds
the next call's queries), so Python dispatch is out of the numbers; the K/V cache rotates over
several copies so that long runs do not measure the L2 cache. Reported: the median over
``reps`` such programs of the time per call, and the bandwidth it implies over the bytes the
call must move (K/V slots 0..ctx+W-1 once, q and out once).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import tree_attention_hopper as hopper
from pallas_kernels.tree_attention import (
    default_block_sizes,
    gpu_limits,
    key_visibility,
    tree_attention,
    tree_attention_pallas,
    tree_attention_reference,
)

# Rotate K/V copies until they span 2x an H200's 60 MB L2, but at most 2: each copy is one more
# unrolled call to compile. Short contexts therefore read partly from L2; they are launch-bound.
_ROTATE_BYTES = 120e6
_MAX_COPIES = 2


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    ctx: int
    width: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def max_len(self) -> int:
        """Cache slots: ctx + W rounded up to a multiple of 8 (the Hopper kernel's TMA tiling
        needs that, and the model's caches have it; W 257 would otherwise leave 4353)."""
        return -(-(self.ctx + self.width) // 8) * 8

    def kv_bytes(self, itemsize: int) -> int:
        """Bytes of K and V in slots 0..ctx+W-1."""
        return 2 * self.batch * (self.ctx + self.width) * self.kv_heads * self.head_dim * itemsize

    def min_bytes(self, itemsize: int) -> int:
        """K/V read once, q read once, out written once."""
        q_bytes = self.batch * self.width * self.q_heads * self.head_dim * itemsize
        return self.kv_bytes(itemsize) + 2 * q_bytes


def random_tree_visibility(rng: np.random.Generator, batch: int, width: int) -> np.ndarray:
    """[batch, width, width] ancestor-or-self masks of random trees (parent[i] < i, root 0)."""
    visible = np.zeros((batch, width, width), dtype=bool)
    for b in range(batch):
        parent = [-1] + [int(rng.integers(0, i)) for i in range(1, width)]
        for t in range(width):
            node = t
            while node >= 0:
                visible[b, t, node] = True
                node = parent[node]
    return visible


def make_inputs(shape: Shape, dtype: jnp.dtype, copies: int, seed: int = 0):
    """Random q, `copies` K/V caches [batch, max_len, kv_heads, head_dim], lens, visibility."""
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (shape.batch, shape.width, shape.q_heads, shape.head_dim), dtype)
    cache_shape = (shape.batch, shape.max_len, shape.kv_heads, shape.head_dim)
    ks = tuple(jax.random.normal(k_, cache_shape, dtype) for k_ in jax.random.split(kk, copies))
    vs = tuple(jax.random.normal(v_, cache_shape, dtype) for v_ in jax.random.split(kv, copies))
    lens = jnp.full((shape.batch,), shape.ctx, jnp.int32)
    if shape.width == 1:
        visible = None
    else:
        rng = np.random.default_rng(seed)
        # int8, the kernel's own format, made once outside the timed calls as XLA's mask is. (In
        # the model every layer converts the same bool array; that XLA merges those converts
        # into one is expected, not measured.)
        visible = jnp.asarray(random_tree_visibility(rng, shape.batch, shape.width), jnp.int8)
    return q, ks, vs, lens, visible


AttnFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, "jax.Array | None"], jax.Array]


def xla_masked_attention(q, k, v, prefix_lens, visible, *, mask: jax.Array) -> jax.Array:
    """jax.nn.dot_product_attention with a precomputed [batch, 1, W, max_len] mask."""
    del prefix_lens, visible
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def cudnn_masked_attention(q, k, v, prefix_lens, visible, *, mask: jax.Array) -> jax.Array:
    """The same masked attention through cuDNN's fused attention (GPU only): a second baseline."""
    del prefix_lens, visible
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def timed_program(attn: AttnFn, iters: int, copies: int, unrolled: bool = False):
    """A jitted program running `iters` chained calls of attn over rotating K/V copies.

    unrolled: the calls as straight-line code instead of a loop. An XLA while loop costs the
    GPU a few microseconds per iteration (its trip test goes through the host), which is
    the same order as one call at short contexts; unrolled, back-to-back calls are what remain.
    """
    assert iters % copies == 0

    @jax.jit
    def run(q, ks, vs, lens, visible):
        def body(_, q_):
            for c in range(copies):  # static unroll: no dynamic slice (copy) of the caches
                q_ = attn(q_, ks[c], vs[c], lens, visible).astype(q_.dtype)
            return q_
        return jax.lax.fori_loop(0, iters // copies, body, q, unroll=unrolled)

    return run


def time_ms(attn: AttnFn, inputs, iters: int, reps: int, unrolled: bool = False) -> float:
    """Median milliseconds per attention call (compile and warm-up excluded)."""
    q, ks, vs, lens, visible = inputs
    run = timed_program(attn, iters, len(ks), unrolled)
    jax.block_until_ready(run(q, ks, vs, lens, visible))  # compile + warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(run(q, ks, vs, lens, visible))
        samples.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(samples)


def device_kernel_us(attn: AttnFn, inputs, iters: int, log_dir: str) -> dict[str, float]:
    """Per-call GPU kernel time by kernel name, from a jax.profiler trace of one timed program.

    Wall time per call includes the host's launch cost, which dominates kernels of a few
    microseconds; this is the time the GPU spent inside kernels.
    """
    import tempfile

    from dflash_jax.bench.profile import kernel_events

    q, ks, vs, lens, visible = inputs
    run = timed_program(attn, iters, len(ks))
    jax.block_until_ready(run(q, ks, vs, lens, visible))
    os.makedirs(log_dir, exist_ok=True)
    trace_dir = tempfile.mkdtemp(dir=log_dir)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(run(q, ks, vs, lens, visible))
    totals: dict[str, float] = {}
    for e in kernel_events(trace_dir):
        totals[e["name"]] = totals.get(e["name"], 0.0) + float(e.get("dur", 0.0)) / iters
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def max_rel_err(out: jax.Array, ref: jax.Array) -> float:
    """max |out - ref| / max |ref| (NaN anywhere gives inf)."""
    out32, ref32 = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if not np.all(np.isfinite(out32)):
        return math.inf
    return float(np.max(np.abs(out32 - ref32)) / max(np.max(np.abs(ref32)), 1e-30))


def _hopper_variant(shape: Shape, **fields) -> AttnFn:
    """`tree_attention_hopper` with its default schedule for `shape` changed by `fields`
    (`fold_tail=true` through `hopper.fold_tail`, which sets the tail's partials to match)."""
    group = shape.q_heads // shape.kv_heads
    fold = fields.pop("fold_tail", False)
    sched = dataclasses.replace(hopper.schedule(1, shape.kv_heads, shape.width * group, shape.max_len,
                                                gpu_limits().num_sms), **fields)
    sched = hopper.fold_tail(sched) if fold else sched
    return functools.partial(hopper.tree_attention_hopper, scale=shape.head_dim ** -0.5, sched=sched)


def bench_shape(shape: Shape, dtype, *, interpret: bool, iters: int, reps: int,
                impls: tuple[str, ...] = ("pallas", "xla", "reference"), check: bool = True,
                overrides: dict | None = None, profile_dir: str | None = None, unrolled: bool = False,
                tilings: list[dict] | None = None, hopper_scheds: dict[str, dict] | None = None) -> dict:
    """Checks and times one shape. overrides: explicit kernel block sizes.

    tilings: more explicit tilings of the kernel, timed as impls "tiling0", "tiling1", ...
    hopper_scheds: the Hopper kernel with its default schedule changed by these fields, timed as
      impls "hopper_<name>".

    profile_dir: also record per-call GPU kernel time (``<impl>_kernel_us``) from a trace.
    unrolled: also time each implementation with the calls unrolled (``<impl>_unrolled_ms``).
    """
    itemsize = jnp.dtype(dtype).itemsize
    copies = int(min(_MAX_COPIES, max(1, math.ceil(_ROTATE_BYTES / shape.kv_bytes(itemsize)))))
    copies = 1 if interpret else copies
    iters = max(copies, iters // copies * copies)
    inputs = make_inputs(shape, dtype, copies)
    q, ks, vs, lens, visible = inputs
    kernel_args = dict(overrides or {})
    mask = key_visibility(lens, visible, shape.width, shape.max_len)[:, None]
    fns = {
        "pallas": functools.partial(tree_attention_pallas, interpret=interpret, **kernel_args),
        "xla": functools.partial(xla_masked_attention, mask=mask),
        "cudnn": functools.partial(cudnn_masked_attention, mask=mask),
        "reference": tree_attention_reference,
        # As the model dispatches it: the Hopper (Mosaic GPU) kernel where it applies.
        "hopper": functools.partial(tree_attention, impl="interpret" if interpret else "pallas"),
    }
    for name, fields in (hopper_scheds or {}).items():
        fns[f"hopper_{name}"] = _hopper_variant(shape, **fields)
    for i, tiling in enumerate(tilings or ()):
        fns[f"tiling{i}"] = functools.partial(tree_attention_pallas, interpret=interpret, **tiling)

    row = dataclasses.asdict(shape)
    blocks = default_block_sizes(shape.batch, shape.width, shape.q_heads // shape.kv_heads,
                                 shape.kv_heads, shape.head_dim, shape.max_len, itemsize)
    row.update(dataclasses.asdict(blocks))
    row.update(kernel_args)
    row.update(copies=copies, iters=iters)
    if check:
        # Kernel (and XLA) against the reference on the same inputs; the reference computes in
        # float32 internally, and reusing its bf16 signature saves a compile per shape.
        ref = jax.jit(tree_attention_reference)(q, ks[0], vs[0], lens, visible)
        for name in list(impls):
            if name != "reference":
                try:
                    out = jax.jit(fns[name])(q, ks[0], vs[0], lens, visible)
                except Exception as exc:  # cuDNN may refuse a shape or mask; the other columns stand
                    if name != "cudnn":
                        raise
                    row["cudnn_error"] = str(exc)[:300]
                    impls = tuple(i for i in impls if i != "cudnn")
                    continue
                row[f"err_{name}"] = max_rel_err(out, ref)
    min_bytes = shape.min_bytes(itemsize)
    for name in impls:
        ms = time_ms(fns[name], inputs, iters, reps)
        row[f"{name}_ms"] = ms
        row[f"{name}_gbps"] = min_bytes / (ms * 1e-3) / 1e9
        if unrolled and name != "reference":
            row[f"{name}_unrolled_ms"] = time_ms(fns[name], inputs, iters, reps, unrolled=True)
        if profile_dir is not None and name != "reference":
            kernels = device_kernel_us(fns[name], inputs, iters, profile_dir)
            row[f"{name}_kernel_us"] = sum(kernels.values())
            row[f"{name}_kernels"] = {k[:60]: round(v, 2) for k, v in list(kernels.items())[:6]}
    return row


def markdown_table(rows: list[dict]) -> str:
    cols = [("ctx", "ctx"), ("width", "W"), ("pallas_ms", "pallas ms"),
            ("pallas_gbps", "pallas GB/s"), ("xla_ms", "xla ms"), ("xla_gbps", "xla GB/s"),
            ("cudnn_ms", "cudnn ms"), ("reference_ms", "ref ms"), ("speedup_vs_xla", "x vs xla"),
            ("speedup_vs_cudnn", "x vs cudnn"),
            ("err_pallas", "pallas rel err"), ("split_k", "split_k"), ("tail_split", "tail split"),
            ("pallas_kernel_us", "pallas kernel us"), ("xla_kernel_us", "xla kernel us"),
            ("kernel_speedup_vs_xla", "x vs xla (kernels)"),
            ("hopper_ms", "hopper ms"), ("hopper_kernel_us", "hopper kernel us"),
            ("hopper_speedup_vs_xla", "hopper x vs xla"), ("err_hopper", "hopper rel err"),
            ("pallas_unrolled_ms", "pallas unrolled ms"),
            ("xla_unrolled_ms", "xla unrolled ms"), ("unrolled_speedup_vs_xla", "x vs xla (unrolled)")]
    cols = [c for c in cols if any(c[0] in r for r in rows)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |",
             "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for key, _ in cols:
            val = r.get(key, "")
            if isinstance(val, float):
                val = f"{val:.3g}" if key.startswith("err") else f"{val:.4g}"
            cells.append(str(val))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_configs(width: int, default_split: int) -> list[dict]:
    """Kernel tilings tried by --sweep for one width (the group is folded into rows)."""
    configs = []
    # 256-row blocks read each kv head's K/V once where W x group = 256 (W = 64, group 4)
    for block_q in ((16,) if width == 1 else (64, 128, 256)):
        for block_k in ((64, 128, 256) if width == 1 else (32, 64, 128)):
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    # 4x too: a grid just over one wave (W = 272: 136 programs on 132 SMs)
                    # may gain from splitting the keys although its default is 1.
                    for split_k in sorted({1, max(1, default_split // 2), default_split,
                                           2 * default_split, 4 * default_split}):
                        configs.append(dict(block_q=block_q, block_k=block_k,
                                            num_warps=num_warps, num_stages=num_stages,
                                            split_k=split_k))
    return configs


def sweep(shapes: list[tuple[int, int]], heads, dtype, iters: int,
          budget_s: float, interpret: bool = False) -> list[dict]:
    """Times alternative tilings per (ctx, width), budget_s in all; prints the best few.

    Configs run in a shuffled order so that a budget cut drops a random subset.
    """
    q_heads, kv_heads, head_dim = heads
    itemsize = jnp.dtype(dtype).itemsize
    started = time.perf_counter()
    rows = []
    for shape_index, (ctx, width) in enumerate(shapes):
        shape_deadline = started + budget_s * (shape_index + 1) / len(shapes)
        shape = Shape(1, ctx, width, q_heads, kv_heads, head_dim)
        copies = int(min(_MAX_COPIES, max(1, math.ceil(_ROTATE_BYTES / shape.kv_bytes(itemsize)))))
        n = max(copies, iters // copies * copies)
        inputs = make_inputs(shape, dtype, copies)
        default = default_block_sizes(1, width, q_heads // kv_heads, kv_heads, head_dim,
                                      shape.max_len, itemsize)
        kernel = functools.partial(tree_attention_pallas, interpret=interpret)
        default_ms = time_ms(kernel, inputs, n, 3)
        # Before the trials, so that a run cut short still says which shape they belong to.
        print(f"ctx={ctx} W={width}: default {default_ms:.4f} ms {default}", flush=True)
        trials = []
        configs = sweep_configs(width, default.split_k)
        np.random.default_rng(0).shuffle(configs)
        for cfg in configs:
            if time.perf_counter() > shape_deadline:
                break
            try:
                ms = time_ms(functools.partial(kernel, **cfg), inputs, n, 3)
            except Exception as exc:  # a tiling Triton rejects (e.g. shared memory)
                print(f"  {cfg}: failed {str(exc)[:100]}")
                continue
            trials.append(dict(cfg, ms=round(ms, 5)))
            print(f"  {trials[-1]}", flush=True)  # as it goes: a run cut short keeps its trials
        trials.sort(key=lambda r: r["ms"])
        print(f"ctx={ctx} W={width}: best of {len(trials)} tried "
              f"({time.perf_counter() - started:.0f} s), against the default's {default_ms:.4f} ms:", flush=True)
        for t in trials[:5]:
            print(f"    {t}", flush=True)
        rows.append(dict(ctx=ctx, width=width, default_ms=default_ms, trials=trials))
    return rows


def parse_tilings(specs: list[str]) -> list[tuple[int, dict]]:
    """--tiling values "W:block_q,block_k,num_warps,num_stages,split_k[,tail_split]" as
    (W, tree_attention_pallas keyword arguments)."""
    names = ("block_q", "block_k", "num_warps", "num_stages", "split_k", "tail_split")
    out = []
    for spec in specs:
        try:
            width, values = spec.split(":")
            numbers = [int(x) for x in values.split(",")]
            if not 5 <= len(numbers) <= len(names):
                raise ValueError
        except ValueError:
            raise SystemExit(f"--tiling {spec!r}: expected W:block_q,block_k,num_warps,num_stages,split_k"
                             f"[,tail_split]") from None
        out.append((int(width), dict(zip(names, numbers))))
    return out


def write_json(path: str, rows: list[dict], skipped: list[dict], started: float,
               args: argparse.Namespace, dtype) -> dict:
    result = dict(
        device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
        jax_version=jax.__version__, python=platform.python_version(),
        date=time.strftime("%Y-%m-%d"), dtype=jnp.dtype(dtype).name,
        interpret=args.interpret, iters=args.iters, reps=args.reps,
        seconds=time.perf_counter() - started, rows=rows, skipped=skipped)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return result


def parse_hopper_scheds(specs: list[str]) -> dict[str, dict]:
    """["bk64:block_k=64,stages=4", ...] -> {"bk64": {"block_k": 64, "stages": 4}}; fields must be
    `tree_attention_hopper.Schedule`'s, values ints or true/false."""
    fields = {f.name for f in dataclasses.fields(hopper.Schedule)}
    out = {}
    for spec in specs:
        name, _, body = spec.partition(":")
        parsed = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in fields:
                raise SystemExit(f"--hopper-sched {spec!r}: {key!r} is not a Schedule field ({sorted(fields)})")
            low = value.lower()
            parsed[key] = (low == "true") if low in ("true", "false") else int(value)
        if not name or not parsed:
            raise SystemExit(f"--hopper-sched {spec!r}: expected NAME:FIELD=V[,FIELD=V]")
        out[name] = parsed
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tree_attention_bench.json", help="JSON results path")
    parser.add_argument("--quick", action="store_true", help="few small shapes")
    parser.add_argument("--interpret", action="store_true",
                        help="run the kernel in Pallas interpret mode (CPU smoke test)")
    parser.add_argument("--sweep", action="store_true",
                        help="also time alternative tilings (for retuning default_block_sizes)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="also measure GPU kernel time per call with jax.profiler (to DIR)")
    parser.add_argument("--sweep-budget", type=float, default=420.0, help="seconds")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="override the prefix lengths")
    parser.add_argument("--widths", type=int, nargs="+", default=None,
                        help="override the widths W")
    parser.add_argument("--cudnn", action="store_true",
                        help="also time cuDNN's fused attention with the same mask (GPU only)")
    parser.add_argument("--hopper", action="store_true",
                        help="also time the kernels as the model dispatches them (the Hopper kernel on "
                             "sm_90 where it applies; pallas_kernels.tree_attention.hopper_applies)")
    parser.add_argument("--tiling", action="append", default=[], metavar="W:Q,K,WARPS,STAGES,SPLIT[,TAIL]",
                        help="also time this explicit tiling at width W (block_q, block_k, num_warps, "
                             "num_stages, split_k, tail_split); repeatable")
    parser.add_argument("--hopper-sched", action="append", default=[], metavar="NAME:FIELD=V[,FIELD=V]",
                        help="with --hopper: also time the Hopper kernel with these Schedule fields changed "
                             "(as hopper_NAME; e.g. bk64:block_k=64,stages=4); repeatable")
    parser.add_argument("--unrolled", action="store_true",
                        help="also time every implementation with its calls unrolled (no loop overhead)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget", type=float, default=210.0,
                        help="seconds; shapes not started by then are skipped (and listed)")
    args = parser.parse_args(argv)

    if args.interpret:
        # Tiny heads so that interpret mode finishes in seconds on a CPU.
        heads, contexts, widths, dtype = (4, 2, 64), (64, 96), (1, 16), jnp.float32
        args.iters, args.reps = 2, 1
    else:
        heads, dtype = (32, 8, 128), jnp.bfloat16
        contexts = (1024, 16384) if args.quick else (1024, 4096, 16384, 32768)
        widths = (1, 16, 256) if args.quick else (1, 16, 64, 256, 512)
    contexts = tuple(args.contexts or contexts)
    widths = tuple(args.widths or widths)
    q_heads, kv_heads, head_dim = heads

    rows, skipped = [], []
    started = time.perf_counter()
    if args.sweep:
        shapes = [(32768, 256), (32768, 1), (16384, 512), (32768, 16), (4096, 256), (16384, 1)]
        if args.contexts or args.widths:  # the shapes asked for instead of the default set
            shapes = [(c, w) for c in contexts for w in widths]
        rows = sweep(shapes, heads, dtype, args.iters, args.sweep_budget, args.interpret)
    else:
        for ctx, width in [(c, w) for c in contexts for w in widths]:
            if time.perf_counter() - started > args.budget:
                skipped.append(dict(ctx=ctx, width=width))
                print(f"ctx={ctx} W={width}: skipped (over --budget)", flush=True)
                continue
            shape = Shape(1, ctx, width, q_heads, kv_heads, head_dim)
            impls = ("pallas", "xla", "cudnn", "reference") if args.cudnn else ("pallas", "xla", "reference")
            tilings = [t for w, t in parse_tilings(args.tiling) if w == width]
            # The schedules run the Mosaic GPU kernel itself, which has no interpret mode.
            scheds = parse_hopper_scheds(args.hopper_sched) if args.hopper and not args.interpret else {}
            hoppers = ("hopper",) + tuple(f"hopper_{name}" for name in scheds)
            candidates = (hoppers if args.hopper else ()) + tuple(f"tiling{i}" for i in range(len(tilings)))
            impls = ("pallas",) + candidates + impls[1:]
            row = bench_shape(shape, dtype, interpret=args.interpret, iters=args.iters,
                              reps=args.reps, profile_dir=args.profile, impls=impls, unrolled=args.unrolled,
                              tilings=tilings, hopper_scheds=scheds)
            for name, fields in scheds.items():
                row[f"hopper_{name}"] = fields
            for i, tiling in enumerate(tilings):
                row[f"tiling{i}"] = tiling
            row["speedup_vs_xla"] = row["xla_ms"] / row["pallas_ms"]
            for name in candidates:
                row[f"{name}_speedup_vs_xla"] = row["xla_ms"] / row[f"{name}_ms"]
                kernel = f", kernel {row[f'{name}_kernel_us']:.1f} us" if args.profile else ""
                print(f"  {name} {row.get(name, '')}: {row[f'{name}_ms']:.4f} ms{kernel} (err "
                      f"{row[f'err_{name}']:.2e}, {row[f'{name}_speedup_vs_xla']:.2f}x xla)", flush=True)
            if args.unrolled:
                row["unrolled_speedup_vs_xla"] = row["xla_unrolled_ms"] / row["pallas_unrolled_ms"]
                print(f"  unrolled: pallas {row['pallas_unrolled_ms']:.4f} ms, xla {row['xla_unrolled_ms']:.4f} ms "
                      f"({row['unrolled_speedup_vs_xla']:.2f}x)", flush=True)
            if args.profile:
                row["kernel_speedup_vs_xla"] = row["xla_kernel_us"] / row["pallas_kernel_us"]
            if "cudnn_ms" in row:
                row["speedup_vs_cudnn"] = row["cudnn_ms"] / row["pallas_ms"]
                print(f"  cudnn {row['cudnn_ms']:.4f} ms (err {row['err_cudnn']:.2e})", flush=True)
            elif "cudnn_error" in row:
                print(f"  cudnn failed: {row['cudnn_error'][:200]}", flush=True)
            rows.append(row)
            print(f"ctx={ctx} W={width}: pallas {row['pallas_ms']:.4f} ms "
                  f"({row['pallas_gbps']:.0f} GB/s, err {row['err_pallas']:.2e}), "
                  f"xla {row['xla_ms']:.4f} ms (err {row['err_xla']:.2e}), "
                  f"ref {row['reference_ms']:.4f} ms", flush=True)
            if args.profile:
                print(f"  kernel us: pallas {row['pallas_kernel_us']:.1f} "
                      f"{row['pallas_kernels']}\n  xla {row['xla_kernel_us']:.1f} "
                      f"{row['xla_kernels']}", flush=True)
            write_json(args.out, rows, skipped, started, args, dtype)  # survives a kill

    result = write_json(args.out, rows, skipped, started, args, dtype)
    print(f"\n{result['device']}, jax {jax.__version__}, {result['dtype']}, "
          f"heads {q_heads}/{kv_heads}x{head_dim}, batch 1, {result['seconds']:.0f} s\n")
    if not args.sweep:
        print(markdown_table(rows))


if __name__ == "__main__":
    main()
