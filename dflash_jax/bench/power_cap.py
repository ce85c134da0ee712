"""The verify's products under sustained load: what the GPU's power limit costs them.

A DDTree(256) round on an H200 runs at the board's 700 W limit, the SM clock near 1665 of 1980
MHz (BENCHMARKS.md, twenty-seventh session). Here one program chains a product over `--layers`
distinct weights at the verify's rows (gate_up by default: [257, 4096] x [4096, 2 x 12288], as
36 layers take it), and after `--rest` seconds idle runs it back to back for `--seconds`, with
the clock, power and throttle reasons sampled every 20 ms (`clocks.ClockSampler`). It reports
the calls of the first `--early` seconds (clocks up, the power budget not yet spent) against
the last `--tail` calls, and the samples of the same two windows.

    python -m dflash_jax.bench.power_cap --out power_cap.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.clocks import ClockSampler, summarize_samples
from dflash_jax.bench.common import environment, log, write_json

PERIOD_MS = 20


def chained_product(rows: int, embed: int, out: int, layers: int):
    """(call, flops per call): x [rows, embed] through `layers` weights [embed, out], each whole
    product kept (an optimization barrier, so XLA cannot shrink it to the columns used) and its
    first `embed` columns feeding the next."""
    keys = jax.random.split(jax.random.key(0), layers + 1)
    x = jax.random.normal(keys[0], (rows, embed), jnp.bfloat16)
    ws = [(jax.random.normal(k, (embed, out), jnp.float32) * embed ** -0.5).astype(jnp.bfloat16) for k in keys[1:]]

    @jax.jit
    def run(x, ws):
        for w in ws:
            y = jax.lax.optimization_barrier(jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
            x = y[:, :embed]
        return x

    return (lambda: run(x, ws)), 2 * rows * embed * out * layers


def windows(starts: list[float], times: list[float], samples: list, early_s: float, tail: int
            ) -> dict[str, Any]:
    """Median ms of the calls that started within `early_s` of the first (the first two left
    out) and of the last `tail` calls, with the clock samples of the same spans."""
    t0 = starts[0]
    early = [ms for t, ms in zip(starts[2:], times[2:]) if t - t0 < early_s]
    n_early = int(early_s * 1000 / PERIOD_MS)
    n_late = max(1, int(sum(times[-tail:]) / PERIOD_MS))
    return {"early_ms": round(statistics.median(early), 4) if early else None, "early_calls": len(early),
            "late_ms": round(statistics.median(times[-tail:]), 4), "late_calls": len(times[-tail:]),
            "early_clocks": summarize_samples(samples[:n_early]),
            "late_clocks": summarize_samples(samples[-n_late:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=257)
    ap.add_argument("--embed", type=int, default=4096)
    ap.add_argument("--out-features", type=int, default=2 * 12288)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rest", type=float, default=5.0, help="seconds idle before the run")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long the run lasts")
    ap.add_argument("--early", type=float, default=0.3, help="seconds from the start that count as early")
    ap.add_argument("--tail", type=int, default=200, help="calls at the end the late median takes")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    call, flops = chained_product(args.rows, args.embed, args.out_features, args.layers)
    for _ in range(3):  # compile and warm up
        jax.block_until_ready(call())
    time.sleep(args.rest)
    starts, times = [], []
    with ClockSampler(period_ms=PERIOD_MS) as clocks:
        t_end = time.perf_counter() + args.seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            starts.append(t0)
            times.append((time.perf_counter() - t0) * 1e3)
    row: dict[str, Any] = {"product": [args.rows, args.embed, args.out_features], "layers": args.layers,
                           "calls": len(times), "clocks": clocks.summary,
                           **windows(starts, times, clocks.samples, args.early, args.tail)}
    for key in ("early", "late"):
        if row[f"{key}_ms"]:
            row[f"{key}_tflop_s"] = round(flops / row[f"{key}_ms"] / 1e9, 1)
    log(row)
    print(f"\n{env['device']}, jax {env['jax']}: {args.layers} products [{args.rows}, {args.embed}] x "
          f"[{args.embed}, {args.out_features}] a call, back to back for {args.seconds} s after {args.rest} s idle")
    print("| window | calls | ms a call | TFLOP/s | SM clock MHz (median) | power W (median) | power-capped |")
    print("|---|---|---|---|---|---|---|")
    for key in ("early", "late"):
        c = row[f"{key}_clocks"]
        print(f"| {key} | {row[f'{key}_calls']} | {row[f'{key}_ms']} | {row.get(f'{key}_tflop_s')} | "
              f"{c.get('sm_clock_mhz', {}).get('median')} | {c.get('power_w', {}).get('median')} | "
              f"{c.get('power_capped')} |")
    write_json(args.out, {"env": env, "row": row})


if __name__ == "__main__":
    main()
