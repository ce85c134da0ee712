"""A round as decoding runs it: the generation's own loop, against the round benchmark's.

`spec_round` times rounds in a `fori_loop` of 8, whose trip count XLA knows, so the host issues
round after round without waiting. The generation (`speculative.generate_speculative`) loops until
every sequence is done: a `while_loop` whose condition the host reads back before it issues the
next round (XLA's while thunk), so each round starts with the GPU waiting for the host to issue
its first kernels. `SpecSettings.rounds_per_check` = k reads `done` once every k rounds. `--command-buffers` compiles
the generation with XLA's command buffers (CUDA graphs) on as well: with WHILE and CONDITIONAL
among their types, XLA may run the loop itself as a graph with conditional nodes, which needs no
host read of the condition. The generations are timed in turns.

Per setting, on the random-weight target (Qwen3-8B shape, 5-layer drafter, batch 1, a random
prompt of --ctx tokens): the median wall time of a whole generation of --new tokens, of the
prefill alone (`speculative.start_state`, compiled the same way), and so the decode time per
round run (`(generation - prefill) / rounds run`, where rounds run = k * ceil(rounds / k)) and per
round needed. Beside them, in the same process, `spec_round`'s 8-round call.

    python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 64 --rounds-per-check 1 4 8
    python -m dflash_jax.bench.decode_loop --rounds-per-check 1 --command-buffers off all
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.common import SHAPES, environment, log, time_fn, write_json
from dflash_jax.model import kernel_mlp_layout
from dflash_jax.bench.spec_round import COMMAND_BUFFERS, decoding_pair, make_state, timed_rounds
from dflash_jax.speculative import (_STATIC, DDTREE_COMPILER_OPTIONS, SpecSettings, _generate, speculative_program,
                                   start_state)


def generation_program(s: SpecSettings, command_buffers: str):
    """The generation as decoding compiles it ("off": `speculative_program`), or with XLA's command
    buffers as `spec_round --command-buffers` names them (the dot merger off, as for DDTree)."""
    if command_buffers == "off":
        return speculative_program(s)
    options = {**DDTREE_COMPILER_OPTIONS, **COMMAND_BUFFERS[command_buffers]}
    return jax.jit(_generate, static_argnames=_STATIC, compiler_options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="max new tokens per generation")
    ap.add_argument("--rounds-per-check", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--command-buffers", nargs="+", default=["off"], choices=["off"] + sorted(COMMAND_BUFFERS),
                    help="XLA's command buffers for the generation: off (as decoding compiles it), or as "
                         "spec_round names them, e.g. all (every type, WHILE and CONDITIONAL among them); "
                         "several: each is timed")
    ap.add_argument("--mlp", nargs="+", choices=("xla", "kernel"), default=["xla"],
                    help="the verify's MLP: XLA's gate_up product and SiLU, or the gated-activation kernel "
                         "(the target in `model.kernel_mlp_layout`); several: each is timed")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    cfg, dcfg, dparams, target = decoding_pair(args.model)
    prompts = jax.random.randint(jax.random.key(2), (1, args.ctx), 0, cfg.vocab_size - 1, jnp.int32)
    lens = jnp.full((1,), args.ctx, jnp.int32)
    key = jax.random.key(0)
    base = SpecSettings(method="ddtree", budget=args.budget, block_size=dcfg.block_size, max_new_tokens=args.new)
    max_len = -(-(args.ctx + args.new + base.cache_slack()) // 128) * 128
    log("weights ready")

    prefill = jax.jit(lambda t, d, p, l, k: start_state(t, cfg, d, dcfg, p, l, k, max_len, base),
                      compiler_options=DDTREE_COMPILER_OPTIONS)
    prefill_ms = time_fn(lambda: prefill(target, dparams, prompts, lens, key).count, warmup=1,
                         iters=args.iters)["median_ms"]
    log(f"prefill {prefill_ms:.2f} ms")
    targets = {"xla": target}
    if "kernel" in args.mlp:  # both layouts kept: 7 GB more at Qwen3-8B
        targets["kernel"] = kernel_mlp_layout(target)
    programs = []
    first_tokens = None
    for cb, mlp, k in itertools.product(args.command_buffers, args.mlp, args.rounds_per_check):
        s = dataclasses.replace(base, rounds_per_check=k)
        t0 = time.perf_counter()
        # Compiled ahead of time; the static arguments are baked in.
        compiled = generation_program(s, cb).lower(targets[mlp], cfg, dparams, dcfg, prompts, lens, key,
                                                   settings=s, max_len=max_len).compile()
        gen = compiled(targets[mlp], dparams, prompts, lens, key)
        rounds = int(jax.device_get(gen.rounds).max())
        tokens = jax.device_get(gen.tokens)
        first_tokens = tokens if first_tokens is None else first_tokens
        same = bool((tokens == first_tokens).all())
        programs.append((cb, mlp, k, rounds, same, compiled, round(time.perf_counter() - t0, 1)))
    # Timed in turns, one generation of each per turn, so drift falls on all alike.
    times: list[list[float]] = [[] for _ in programs]
    for _ in range(args.iters):
        for i, (_, mlp, *_, compiled, _) in enumerate(programs):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(targets[mlp], dparams, prompts, lens, key).tokens)
            times[i].append((time.perf_counter() - t0) * 1e3)
    rows: list[dict[str, Any]] = []
    for (cb, mlp, k, rounds, same, _, first_s), ts in zip(programs, times):
        total = statistics.median(ts)
        run = k * math.ceil(rounds / k)
        row = {"command_buffers": cb, "mlp": mlp, "tokens_as_first": same, "rounds_per_check": k, "rounds": rounds, "rounds_run": run,
               "generation_ms": round(total, 2), "prefill_ms": round(prefill_ms, 2),
               "ms_per_round_run": round((total - prefill_ms) / run, 3),
               "ms_per_round_needed": round((total - prefill_ms) / rounds, 3), "first_call_s": first_s,
               "generation_ms_turns": [round(t, 2) for t in ts]}
        log(row)
        rows.append(row)
    # The round benchmark's program, same weights, same context, same process, with each
    # command-buffer setting (off: as DDTree decoding compiles it).
    bench: dict[str, float] = {}
    for cb in args.command_buffers:
        state = make_state(cfg, dcfg, args.ctx, max_len, base.max_new_tokens, jnp.bfloat16)  # donated
        options = DDTREE_COMPILER_OPTIONS if cb == "off" else {**DDTREE_COMPILER_OPTIONS, **COMMAND_BUFFERS[cb]}
        bench[cb], _, _ = timed_rounds(target, dparams, cfg, dcfg, base, state, options)
        log(f"spec_round's 8-round call, command buffers {cb}: {bench[cb]:.3f} ms a round")
    print(f"\n{env['device']}, jax {env['jax']}, DDTree({args.budget}), prompt {args.ctx}, {args.new} new tokens, "
          f"batch 1 (random weights: about one token a round)")
    print("| command buffers | MLP | tokens as the first row's | rounds per check | rounds | rounds run | generation ms "
          "| prefill ms | ms / round run | ms / round needed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['command_buffers']} | {r['mlp']} | {r['tokens_as_first']} | {r['rounds_per_check']} | "
              f"{r['rounds']} | {r['rounds_run']} | "
              f"{r['generation_ms']} | {r['prefill_ms']} | {r['ms_per_round_run']} | {r['ms_per_round_needed']} |")
    for cb, ms in bench.items():
        print(f"| {cb}: spec_round (fori_loop of 8) | xla | | | | | | | {ms:.3f} | |")
    if args.out:
        write_json(args.out, {"env": env, "rows": rows, "spec_round_ms": bench})


if __name__ == "__main__":
    main()
