"""The same rounds with the GPU rested and sustained: what the board's power limit costs a round.

A DDTree(256) round draws the H200 to its 700 W limit (BENCHMARKS.md, twenty-seventh session),
and kernels made faster alone have not made the sustained round faster (thirty-second session).
This times spec_round's compiled call (`--rounds` rounds in one on-device loop, compiled as
decoding compiles DDTree) three ways, in one process, on one compiled program:

* rested: `--calls` calls, each after `--rest` seconds idle, so the GPU starts each call below
  its power limit;
* sustained: back to back for `--sustain` seconds, as decoding runs rounds; the figure is the
  median of the second half of the calls, once the power limit holds;
* rested again, to show the first phase was not a warm-up artefact.

Per phase: ms per round (median, min, max) and the SM clock and power that `nvidia-smi` sampled
(every 50 ms) while it ran. The sustained figure is the one a decoding user gets; the rested one
says how fast the same work runs with power to spare.

    python -m dflash_jax.bench.power_headroom --budget 256 --ctx 4096
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dflash_jax.bench.clocks import ClockSampler
from dflash_jax.bench.common import environment, log, write_json
from dflash_jax.bench.spec_round import decoding_options, decoding_pair, make_state, round_program
from dflash_jax.speculative import SpecSettings


def timed_calls(call: Callable[[], Any], *, calls: int = 0, rest_s: float = 0.0, seconds: float = 0.0
                ) -> list[float]:
    """Wall ms of each `call()` (blocked until ready): `calls` of them, each after `rest_s` of
    sleep, or, with `seconds`, back to back until that much time has passed."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while (len(times) < calls) if not seconds else (time.perf_counter() < end):
        if rest_s:
            time.sleep(rest_s)
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def phase_row(name: str, times_ms: list[float], rounds: int, clocks: dict[str, Any]) -> dict[str, Any]:
    per_round = [t / rounds for t in times_ms]
    return {"phase": name, "calls": len(per_round), "ms_per_round": round(statistics.median(per_round), 3),
            "min": round(min(per_round), 3), "max": round(max(per_round), 3), "clocks": clocks,
            "ms_per_round_all": [round(t, 3) for t in per_round]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=8, help="rounds per compiled call")
    ap.add_argument("--calls", type=int, default=8, help="calls per rested phase")
    ap.add_argument("--rest", type=float, default=1.5, help="seconds idle before each rested call")
    ap.add_argument("--sustain", type=float, default=4.0, help="seconds of back-to-back calls")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    cfg, dcfg, dparams, target = decoding_pair(args.model)
    s = SpecSettings(method="ddtree", budget=args.budget, block_size=dcfg.block_size, max_new_tokens=64)
    max_len = -(-(args.ctx + s.max_new_tokens + s.cache_slack()) // 128) * 128
    state = make_state(cfg, dcfg, args.ctx, max_len, s.max_new_tokens, jnp.bfloat16)
    start = jnp.array(state.cache.lengths)
    program = round_program(cfg, dcfg, s, args.rounds).lower(state, start, target=target, dparams=dparams).compile(
        compiler_options=decoding_options(s.method) or None)
    box = {"state": state}

    def call() -> jax.Array:
        box["state"] = program(box["state"], start, target=target, dparams=dparams)
        return box["state"].count

    timed_calls(call, calls=3)  # warm-up
    log("compiled and warm")
    rows = []
    for name, kw in (("rested", dict(calls=args.calls, rest_s=args.rest)), ("sustained", dict(seconds=args.sustain)),
                     ("rested again", dict(calls=args.calls, rest_s=args.rest))):
        with ClockSampler() as sampler:
            times = timed_calls(call, **kw)
        if name == "sustained":  # once the limit holds
            times = times[len(times) // 2:]
        rows.append(phase_row(name, times, args.rounds, sampler.summary))
        log({k: v for k, v in rows[-1].items() if k != "ms_per_round_all"})
    print(f"\n{env['device']}, jax {env['jax']}, DDTree({args.budget}) at ctx {args.ctx}, {args.rounds} rounds a call, "
          f"compiled as decoding compiles it")
    print("| phase | calls | ms a round: median (min-max) | SM clock MHz, median | power W, median | power-capped |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        c = r["clocks"]
        clock = c.get("sm_clock_mhz", {}).get("median", "-")
        power = c.get("power_w", {}).get("median", "-")
        print(f"| {r['phase']} | {r['calls']} | {r['ms_per_round']} ({r['min']}-{r['max']}) | {clock} | {power} | "
              f"{c.get('power_capped', c.get('error', '-'))} |")
    if args.out:
        write_json(args.out, {"env": env, "settings": dataclasses.asdict(s), "rows": rows})


if __name__ == "__main__":
    main()
