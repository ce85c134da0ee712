"""Whether the host or the GPU sets the pace of a fused DDTree round.

The round's profile shows GPU idle time in its stages of short kernels (the tree, the draft,
the loop's own copies) that the kernel-to-kernel gaps of programmatic dependent launch do not
explain, and adding launches that cost the host more (Mosaic GPU kernels) made rounds slower
while their kernels got faster (BENCHMARKS.md, twenty-fourth session). If the host issues a
round's ~660 launches at about the pace the GPU runs them, every stretch of short kernels drains
the queue and the GPU waits for the host. This measures, for one compiled round program (the one
`spec_round` times):

* `wall ms / round`: a call's wall time per round (median after warm-up, compile excluded);
* `issue ms / round`: the time until the call returns, before its result is waited for, per
  round: what the host spends issuing the round's launches (the runtime issues on the calling
  thread);
* `pipelined ms / round`: `--pipeline` calls issued back to back, the next while the last runs,
  per round: the pace where a call's start does not wait for the host;
* from a profiler trace, per kernel, the **slack**: the kernel's start on the GPU minus the end of
  the host's launch call for it (matched by CUPTI correlation id). A kernel with little slack was
  waiting for the host; by stage: the median slack, and the share of kernels and of idle GPU time
  with slack under 10 us;
* the host's costliest trace events on the launching thread (per round), to name what it spends
  its time on.

    python -m dflash_jax.bench.host_pace --budget 256 --ctx 4096 --out host_pace.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.common import SHAPES, environment, log, write_json
from dflash_jax.bench.launch_cost import issue_us
from dflash_jax.bench.profile import hlo_op_names, on_gpu_stream, scope_of, thread_names, trace_events
from dflash_jax.bench.spec_round import decoding_pair, make_state, timed_rounds
from dflash_jax.speculative import DDTREE_PROFILED_OPTIONS, SpecSettings
from dflash_jax.stage_times import STAGES

_CORRELATION_KEYS = ("correlation_id", "correlation id", "correlationId")
SLACK_US = 10.0


def _correlation(event: dict[str, Any]) -> str | None:
    args = event.get("args", {})
    for key in _CORRELATION_KEYS:
        if key in args:
            return str(args[key])
    return None


def split_events(events: list[dict[str, Any]]) -> tuple[list[dict], list[dict], dict[tuple, str]]:
    """(GPU kernel events on stream lines, host events, thread names) of a perfetto trace."""
    threads = thread_names(events)
    gpu, host = [], []
    for e in events:
        if e.get("ph") == "X":
            (gpu if on_gpu_stream(e, threads) else host).append(e)
    return gpu, host, threads


def slack_by_scope(gpu: list[dict], host: list[dict], names: dict[str, str], calls: int
                   ) -> dict[str, Any]:
    """Per stage: kernels, median slack (us), kernels and idle GPU time (ms per call) with slack
    under SLACK_US. Idle time is the gap before a kernel since the previous kernel's end, the
    host's turns between the traced calls included (they fall before the calls' first kernels)."""
    launch_end = {}
    for e in host:
        c = _correlation(e)
        if c is not None:
            launch_end[c] = max(launch_end.get(c, 0.0), float(e["ts"]) + float(e.get("dur", 0.0)))
    kernels = sorted(gpu, key=lambda e: float(e["ts"]))
    out: dict[str, dict[str, Any]] = {}
    matched = 0
    prev_end = None
    for e in kernels:
        start, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))
        gap = 0.0 if prev_end is None else max(0.0, start - prev_end)
        prev_end = end if prev_end is None else max(prev_end, end)
        args = e.get("args", {})
        op = names.get(str(args.get("hlo_op", "")), "") or names.get(str(e.get("name", "")), "")
        scope = scope_of(op, STAGES)
        row = out.setdefault(scope, {"kernels": 0, "slack": [], "tight": 0, "tight_idle_ms": 0.0, "idle_ms": 0.0})
        row["kernels"] += 1
        row["idle_ms"] += gap / 1e3
        c = _correlation(e)
        if c is None or c not in launch_end:
            continue
        matched += 1
        slack = start - launch_end[c]
        row["slack"].append(slack)
        if slack < SLACK_US:
            row["tight"] += 1
            row["tight_idle_ms"] += gap / 1e3
    table = {}
    for scope, row in out.items():
        s = row["slack"]
        table[scope] = {"kernels_per_call": row["kernels"] / calls,
                        "median_slack_us": round(statistics.median(s), 1) if s else None,
                        "min_slack_us": round(min(s), 1) if s else None,
                        f"kernels_slack_under_{int(SLACK_US)}us_per_call": row["tight"] / calls,
                        "idle_ms_per_call": round(row["idle_ms"] / calls, 4),
                        f"idle_ms_slack_under_{int(SLACK_US)}us_per_call": round(row["tight_idle_ms"] / calls, 4)}
    arg_keys = sorted({k for e in kernels[:50] for k in e.get("args", {})})
    return {"matched_kernels": matched, "kernels": len(kernels), "kernel_arg_keys": arg_keys, "by_scope": table}


def launch_calls_by_thread(host: list[dict]) -> dict[tuple, list[dict]]:
    """{(pid, tid): that host thread's launch calls (events with a correlation id)}."""
    per_thread: dict[tuple, list[dict]] = {}
    for e in host:
        if _correlation(e) is not None:
            per_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    return per_thread


def host_costs(host: list[dict], threads: dict[tuple, str], calls: int, top: int = 25) -> dict[str, Any]:
    """The launching thread (the host thread with the most launch calls) and its costliest
    events by name, ms per call (nested events counted each on their own)."""
    per_thread = {key: len(launches) for key, launches in launch_calls_by_thread(host).items()}
    note = None
    if not per_thread:  # no launch calls to find it by: the busiest host thread
        note = ("no host events with a correlation id; arg keys seen: "
                + ", ".join(sorted({k for e in host[:5000] for k in e.get("args", {})})[:30]))
        for e in host:
            key = (e.get("pid"), e.get("tid"))
            per_thread[key] = per_thread.get(key, 0) + 1
        if not per_thread:
            return {"error": note}
    thread = max(per_thread, key=per_thread.get)
    totals: dict[str, list[float]] = {}
    for e in host:
        if (e.get("pid"), e.get("tid")) == thread:
            name = str(e.get("name", ""))[:60]
            t = totals.setdefault(name, [0.0, 0])
            t[0] += float(e.get("dur", 0.0))
            t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    out = {"thread": threads.get(thread, str(thread)), "events_per_call": per_thread[thread] / calls,
           "top": [[name, round(t / 1e3 / calls, 4), n / calls] for name, (t, n) in ranked]}
    return {**out, "note": note} if note else out


def kernel_family(name: str) -> str:
    """The kind of launch a GPU kernel's name says it came from."""
    low = name.lower()
    if "memset" in low:
        return "memset"
    if low.startswith("memcpy"):
        return "memcpy"
    if "mosaic" in low:
        return "mosaic gpu"
    if any(s in low for s in ("nvjet", "cutlass", "cublas", "sm90_xmma", "gemv")) and "gemm_fusion" not in low:
        return "cublas"
    if low.startswith("gemm_fusion") or "triton_gemm" in low:
        return "xla triton gemm"
    if any(low.startswith(s) for s in ("loop_", "input_", "fusion", "wrapped_", "copy", "convert", "transpose",
                                       "reduce", "concatenate", "slice", "dynamic", "select", "bitcast")):
        return "xla fusion"
    return "pallas triton / other"


def launch_costs(gpu: list[dict], host: list[dict], calls: int) -> dict[str, Any]:
    """Host time per launch by kind of kernel, from the launching thread's API events (those
    with a correlation id): `pre_us`, the time since the previous launch call ended (the runtime's
    own work for this launch: XLA's thunk, argument set-up, TMA descriptors); `api_us`, the launch
    call itself (which also holds the time it waits for room in the GPU's queue). Medians, and
    the sum of both per call, ms; with the API names seen."""
    kernel_of = {}
    for e in gpu:
        c = _correlation(e)
        if c is not None:
            kernel_of[c] = str(e.get("name", ""))
    per_thread = launch_calls_by_thread(host)
    if not per_thread:
        return {"error": "no host events with a correlation id"}
    calls_seen = max(per_thread.values(), key=len)
    calls_seen.sort(key=lambda e: float(e["ts"]))
    kinds: dict[str, dict[str, list[float]]] = {}
    api_names: dict[str, int] = {}
    prev_end = None
    for e in calls_seen:
        ts, dur = float(e["ts"]), float(e.get("dur", 0.0))
        name = str(e.get("name", ""))[:40]
        api_names[name] = api_names.get(name, 0) + 1
        kind = kernel_family(kernel_of.get(_correlation(e), name))
        row = kinds.setdefault(kind, {"pre": [], "api": []})
        if prev_end is not None and ts - prev_end < 5000:  # not across calls
            row["pre"].append(ts - prev_end)
        row["api"].append(dur)
        prev_end = ts + dur
    table = {}
    for kind, row in kinds.items():
        pre, api = row["pre"], row["api"]
        table[kind] = {"launches_per_call": len(api) / calls,
                       "median_pre_us": round(statistics.median(pre), 2) if pre else None,
                       "median_api_us": round(statistics.median(api), 2),
                       "ms_per_call": round((sum(pre) + sum(api)) / 1e3 / calls, 4)}
    return {"by_kind": table, "api_names": dict(sorted(api_names.items(), key=lambda kv: -kv[1])[:12])}


def pipelined_ms(fn, depth: int, iters: int = 5) -> float:
    """Median ms of `depth` calls issued back to back (each taking the last one's output)."""
    times = []
    for _ in range(iters):
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        out = None
        for _ in range(depth):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, nargs="+", default=[8], help="rounds per call (several: each)")
    ap.add_argument("--pipeline", type=int, default=4, help="calls issued back to back for the pipelined pace")
    ap.add_argument("--attn-impl", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    cfg, dcfg, dparams, target = decoding_pair(args.model)
    max_len = args.ctx + 1024
    s = SpecSettings(method="ddtree", budget=args.budget, block_size=dcfg.block_size, max_new_tokens=512,
                     attn_impl=args.attn_impl)
    rows = []
    for rounds in args.rounds:
        state = make_state(cfg, dcfg, args.ctx, max_len, s.max_new_tokens, jnp.bfloat16)
        ms, rnd, call = timed_rounds(target, dparams, cfg, dcfg, s, state, DDTREE_PROFILED_OPTIONS, rounds=rounds)
        wall = ms * rounds
        issue = issue_us(call) / 1e3
        piped = pipelined_ms(call, args.pipeline)
        trace = tempfile.mkdtemp()
        calls = 2
        jax.block_until_ready(call())
        with jax.profiler.trace(trace, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(call())
        gpu, host, threads = split_events(trace_events(trace))
        names = hlo_op_names(rnd.as_text())
        row = {"budget": args.budget, "ctx": args.ctx, "rounds_per_call": rounds,
               "wall_ms_per_round": round(wall / rounds, 3), "issue_ms_per_round": round(issue / rounds, 3),
               "pipelined_ms_per_round": round(piped / (args.pipeline * rounds), 3),
               "slack": slack_by_scope(gpu, host, names, calls * rounds),
               "host": host_costs(host, threads, calls * rounds),
               "launches": launch_costs(gpu, host, calls * rounds)}
        log(row)
        rows.append(row)
    for r in rows:
        print(f"\nDDTree({r['budget']}), ctx {r['ctx']}, {r['rounds_per_call']} rounds a call: wall "
              f"{r['wall_ms_per_round']} ms / round, issue {r['issue_ms_per_round']}, pipelined "
              f"{r['pipelined_ms_per_round']} (kernels matched to launches: {r['slack']['matched_kernels']} of "
              f"{r['slack']['kernels']})")
        print("| stage | kernels | median slack us | min slack us | kernels under 10 us | idle ms | idle ms under 10 us |")
        print("|---|---|---|---|---|---|---|")
        for scope, t in sorted(r["slack"]["by_scope"].items()):
            print(f"| {scope} | {t['kernels_per_call']:.1f} | {t['median_slack_us']} | {t['min_slack_us']} | "
                  f"{t[f'kernels_slack_under_{int(SLACK_US)}us_per_call']:.1f} | {t['idle_ms_per_call']} | "
                  f"{t[f'idle_ms_slack_under_{int(SLACK_US)}us_per_call']} |")
        print("host, per round:", json.dumps(r["host"])[:1500])
        launches = r["launches"]
        if "by_kind" in launches:
            print("| launch kind | launches / round | median pre us | median API us | host ms / round |")
            print("|---|---|---|---|---|")
            for kind, t in sorted(launches["by_kind"].items(), key=lambda kv: -kv[1]["ms_per_call"]):
                print(f"| {kind} | {t['launches_per_call']:.1f} | {t['median_pre_us']} | {t['median_api_us']} | "
                      f"{t['ms_per_call']} |")
            print("API calls:", launches["api_names"])
        else:
            print("launches:", launches)
    if args.out:
        write_json(args.out, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
