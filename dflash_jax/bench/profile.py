"""Where the device time of one compiled program goes, read from a `jax.profiler` trace.

Each GPU kernel event in the trace names the HLO instruction it runs (`hlo_op`); the compiled
HLO text maps that instruction to the `op_name` metadata JAX wrote at trace time, which holds
the `jax.named_scope` path (e.g. "jit(spec_round)/verify/dot_general"). So one trace of the
fused program splits its time by stage and by kind of work, with no extra compile: the numbers
are those of the program that actually runs, not of separately compiled pieces.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
from typing import Any, Callable, Sequence

import jax


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: op_name metadata} for every instruction that carries one.

    Each name is also entered in its kernel-name spelling ('.' and '-' as '_'), which is how
    GPU kernels launched for a fusion are named when the trace gives no `hlo_op`.
    """
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            out[m.group(1)] = m.group(2)
            out.setdefault(re.sub(r"[.\-]", "_", m.group(1)), m.group(2))
    return out


def _diagnose(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the trace holds, for when kernels cannot be mapped to HLO instructions."""
    return {"hint": "XLA command buffers (CUDA graphs) hide per-instruction attribution; for a split, "
                    "run again with XLA_FLAGS=--xla_gpu_enable_command_buffer=",
            "sample_events": [{"name": str(e.get("name", ""))[:60],
                               "args": {k: str(v)[:80] for k, v in e.get("args", {}).items()}}
                              for e in events[:3]]}


def trace_events(trace_dir: str) -> list[dict[str, Any]]:
    """The events of the newest perfetto trace under `trace_dir` ([] if there is none)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*perfetto*.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        return []
    with gzip.open(paths[-1], "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def thread_names(events: list[dict[str, Any]]) -> dict[tuple, str]:
    """{(pid, tid): the line's name} of a trace's events (GPU stream lines start with "Stream")."""
    return {(e.get("pid"), e.get("tid")): str(e.get("args", {}).get("name", ""))
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def on_gpu_stream(event: dict[str, Any], threads: dict[tuple, str]) -> bool:
    """Whether a trace event lies on a GPU stream line (`thread_names`)."""
    return threads.get((event.get("pid"), event.get("tid")), "").lower().startswith("stream")


def kernel_events(trace_dir: str) -> list[dict[str, Any]]:
    """Kernel events (GPU stream lines) of the newest perfetto trace under `trace_dir`."""
    events = trace_events(trace_dir)
    threads = thread_names(events)
    gpu = [e for e in events if e.get("ph") == "X" and on_gpu_stream(e, threads)]
    # No GPU streams (a CPU run): the CPU runtime's per-instruction events stand in for kernels.
    return gpu or [e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})]


def classify(kernel: str, op_name: str) -> str:
    """A coarse kind of work for one kernel: what a decode step's time is spent on."""
    prim = op_name.rsplit("/", 1)[-1] if op_name else ""
    low = kernel.lower()
    if "tree_attention" in low or prim == "pallas_call":
        return "attention kernel"
    if prim in ("dot_general", "dot") or low.startswith("dot") or any(
            s in low for s in ("gemm", "gemv", "xmma", "nvjet", "cublas", "cutlass", "matmul")):
        return "matmul"
    if any(s in low for s in ("nccl", "all_reduce", "all-reduce", "allreduce", "all_gather")):
        return "collective"
    if "dynamic_update_slice" in prim or "dynamic-update-slice" in low or "scatter" in prim:
        return "cache write"
    if any(s in prim for s in ("reduce_max", "argmax", "sort", "top_k", "cumsum", "reduce_sum")):
        return "reductions"
    return "elementwise / other"


def scope_of(op_name: str, scopes: Sequence[str]) -> str:
    """The innermost of `scopes` named on the op's path, else "other"."""
    parts = op_name.split("/")
    for part in reversed(parts):
        if part in scopes:
            return part
    return "other"


def profile_program(fn: Callable[[], Any], hlo_text: str, calls: int = 5,
                    scopes: Sequence[str] = (), log_dir: str | None = None,
                    table: int = 0, timeline: bool = False) -> dict[str, Any]:
    """Device time per call of `fn()` (already compiled and warm), split by scope and by kind.

    Returns {"device_ms": kernel time per call, "by_scope": {scope: ms}, "by_kind": {kind: ms},
    "top_kernels": [(name, ms)], "unmapped_ms": kernel time whose instruction was not found}.
    table > 0 adds "kernels": the `table` costliest kernels as [name, ms, launches, kind, op_name]
    per call, to see which op each one serves. timeline adds "timeline": the last traced call's
    kernels in order (`call_timeline`).
    Never raises: a benchmark aid must not stop the run (errors come back as {"error": ...}).
    """
    try:
        names = hlo_op_names(hlo_text)
        jax.block_until_ready(fn())
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        trace_dir = tempfile.mkdtemp(dir=log_dir)
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
        events = kernel_events(trace_dir)
        if not events:
            return {"error": "no kernel events in the trace"}
        by_scope: dict[str, float] = {}
        by_kind: dict[str, float] = {}
        by_kernel: dict[str, float] = {}
        launches: dict[str, int] = {}
        first_op: dict[str, tuple[str, str]] = {}
        spans: list[tuple[float, float, str, str]] = []  # (start us, duration us, scope, name) for the gaps
        unmapped = total = 0.0
        for e in events:
            ms = float(e.get("dur", 0.0)) / 1e3 / calls
            args = e.get("args", {})
            op = names.get(str(args.get("hlo_op", "")), "") or names.get(str(e.get("name", "")), "")
            if not op:
                unmapped += ms
            total += ms
            name = str(e.get("name", ""))
            scope = scope_of(op, scopes)
            if "ts" in e:
                spans.append((float(e["ts"]), float(e.get("dur", 0.0)), scope, name, op))
            by_scope[scope] = by_scope.get(scope, 0.0) + ms
            kind = classify(name, op)
            by_kind[kind] = by_kind.get(kind, 0.0) + ms
            by_kernel[name] = by_kernel.get(name, 0.0) + ms
            launches[name] = launches.get(name, 0) + 1
            first_op.setdefault(name, (kind, op))
        gaps = idle_gaps(spans, calls)
        ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1])
        top = ranked[:8]
        rnd = lambda d: {k: round(v, 4) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
        out = {"device_ms": round(total, 4), "by_scope": rnd(by_scope), "by_kind": rnd(by_kind),
               "top_kernels": [(k[:80], round(v, 4)) for k, v in top], "unmapped_ms": round(unmapped, 4),
               "kernels_per_call": len(events) / calls, "gap_ms": round(sum(gaps.values()), 4),
               "gap_by_scope": rnd(gaps), "gap_sizes": gap_sizes(spans, calls),
               "gap_pairs": gap_pairs(spans, calls)}
        if table > 0:
            out["kernels"] = [[k[:80], round(v, 4), launches[k] / calls, *first_op[k]]
                              for k, v in ranked[:table]]
        if timeline:
            out["timeline"] = call_timeline(spans, calls)
        if unmapped > 0.5 * total:
            out["diagnostic"] = _diagnose(events)
        return out
    except Exception as err:  # noqa: BLE001
        return {"error": repr(err)[:300]}


def call_timeline(spans: Sequence[tuple], calls: int) -> list[list[Any]]:
    """The last of `calls` traced calls, kernel by kernel in start order: [start us from the
    call's first kernel, duration us, idle us before it, scope, kernel name, the op's last two
    path parts]. The calls are told apart by the calls - 1 longest gaps (the host's turns).
    spans: (start us, duration us, scope, kernel name, op name)."""
    ordered = sorted(spans, key=lambda sp: sp[0])
    if not ordered:
        return []
    turns = _gaps(ordered, 1)[::-1][:calls - 1]  # the longest gaps (`_gaps` lists them ascending)
    first = max((g[1][0] for g in turns), default=ordered[0][0])
    out, end = [], None
    for ts, dur, scope, name, *op in ordered:
        if ts < first:
            continue
        idle = max(0.0, ts - end) if end is not None else 0.0
        end = ts + dur if end is None else max(end, ts + dur)
        out.append([round(ts - first, 2), round(dur, 2), round(idle, 2), scope, name[:60],
                    "/".join(str(op[0] if op else "").split("/")[-2:])[:80]])
    return out


def _gaps(spans: Sequence[tuple], calls: int) -> list[tuple[float, tuple, tuple]]:
    """(gap us, the span that waited, the span before it) between consecutive kernels on all
    streams together (overlap is no gap), without the calls - 1 longest (the host's turns
    between calls); spans: (start us, duration us, scope, ...)."""
    found: list[tuple[float, tuple, tuple]] = []
    end, last = None, None
    for span in sorted(spans, key=lambda sp: sp[0]):
        ts, dur = span[0], span[1]
        if end is not None and ts > end:
            found.append((ts - end, span, last))
        if end is None or ts + dur >= end:
            end, last = ts + dur, span
    found.sort(key=lambda g: g[0])
    return found[:max(0, len(found) - (calls - 1))]


def idle_gaps(spans: Sequence[tuple], calls: int) -> dict[str, float]:
    """GPU idle time per call (ms) between consecutive kernels, by the scope of the kernel that
    waited: where launches, host syncs (a while loop's condition) or short kernels leave the GPU
    idle. spans: (start us, duration us, scope, ...) of every kernel, on all streams together
    (overlap counts as no gap); the calls - 1 longest gaps are the host's turns between calls,
    and are left out."""
    out: dict[str, float] = {}
    for gap_us, span, _ in _gaps(spans, calls):
        out[span[2]] = out.get(span[2], 0.0) + gap_us / 1e3 / calls
    return out


GAP_BUCKETS_US = (1.0, 2.0, 5.0, 20.0, float("inf"))


def gap_sizes(spans: Sequence[tuple], calls: int, largest: int = 8) -> dict[str, Any]:
    """How the idle time is made: per call, the count and ms of gaps up to each of
    GAP_BUCKETS_US (many ~1 us gaps are launch latency between dependent kernels; a few long
    ones are the host or a sync), and the `largest` gaps of the traced calls as
    [us, scope that waited, kernel that waited, kernel before]. spans: (start us, duration us,
    scope, kernel name)."""
    found = _gaps(spans, calls)
    buckets = {f"<= {b:g} us" if b != float("inf") else f"> {GAP_BUCKETS_US[-2]:g} us": [0.0, 0.0]
               for b in GAP_BUCKETS_US}
    for gap_us, _, _ in found:
        for b, key in zip(GAP_BUCKETS_US, buckets):
            if gap_us <= b:
                buckets[key][0] += 1 / calls
                buckets[key][1] += gap_us / 1e3 / calls
                break
    return {"buckets": {k: [round(n, 2), round(ms, 4)] for k, (n, ms) in buckets.items()},
            "largest": [[round(g, 2), sp[2], _span_name(sp), _span_name(before)]
                        for g, sp, before in found[::-1][:largest]]}


def _span_name(span: tuple | None, kind: bool = False) -> str:
    """A span's kernel name (its `kernel_kind` if `kind`), cut to 60 characters; "" for none."""
    if span is None or len(span) <= 3:
        return ""
    name = str(span[3])
    return (kernel_kind(name) if kind else name)[:60]


def kernel_kind(name: str) -> str:
    """A kernel's name without the instance numbers XLA appends (fusion_1445 -> fusion,
    "Memset 3" -> Memset), so that the 36 layers' copies of one kernel count together."""
    return re.sub(r"([ _.]\d+)+$", "", name)


def gap_pairs(spans: Sequence[tuple], calls: int, top: int = 16) -> list[list[Any]]:
    """Where the idle time sits: the gaps grouped by (the kernel before, the kernel that waited),
    each by `kernel_kind`, as [count per call, ms per call, mean us, before, waited, scope that
    waited] for the `top` pairs with the most idle time. A pair with a long mean gap is a host
    turn or a launch that costs more than the usual ~1 us. spans: (start us, duration us, scope,
    kernel name)."""
    found: dict[tuple[str, str, str], list[float]] = {}
    for gap_us, span, before in _gaps(spans, calls):
        key = (_span_name(before, kind=True), _span_name(span, kind=True), span[2])
        acc = found.setdefault(key, [0, 0.0])
        acc[0] += 1
        acc[1] += gap_us
    ranked = sorted(found.items(), key=lambda kv: -kv[1][1])[:top]
    return [[round(n / calls, 2), round(us / 1e3 / calls, 4), round(us / n, 2), before, waited, scope]
            for (before, waited, scope), (n, us) in ranked]


def scale_profile(profile: dict[str, Any], n: int) -> dict[str, Any]:
    """A profile of a call that ran `n` rounds (or decode steps), scaled to one of them."""
    if "error" in profile:
        return profile
    scaled = dict(profile)
    for key in ("device_ms", "unmapped_ms", "kernels_per_call", "gap_ms"):
        if key in profile:
            scaled[key] = profile[key] / n
    for key in ("by_scope", "by_kind", "gap_by_scope"):
        if key in profile:
            scaled[key] = {k: v / n for k, v in profile[key].items()}
    scaled["top_kernels"] = [(k, v / n) for k, v in profile["top_kernels"]]
    if "gap_sizes" in profile:
        sizes = profile["gap_sizes"]
        scaled["gap_sizes"] = {**sizes, "buckets": {k: [c / n, ms / n] for k, (c, ms) in sizes["buckets"].items()}}
    if "gap_pairs" in profile:
        scaled["gap_pairs"] = [[c / n, ms / n, *rest] for c, ms, *rest in profile["gap_pairs"]]
    if "kernels" in profile:
        scaled["kernels"] = [[k, ms / n, count / n, *rest] for k, ms, count, *rest in profile["kernels"]]
    return scaled
