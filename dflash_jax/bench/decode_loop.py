"""A round as decoding runs it: the generation's own loop, against the round benchmark's.

`spec_round` times rounds in a `fori_loop` of 8, whose trip count XLA knows, so the host issues
round after round without waiting. The generation (`speculative.generate_speculative`) loops until
every sequence is done: a `while_loop`. Run by the host (XLA's while thunk), it reads the
condition back before it issues the next round, so each round starts with the GPU waiting for the
host to issue its first kernels; `Impl.rounds_per_check` = k reads `done` once every k rounds. With XLA's command buffers (CUDA graphs) for every command type, WHILE and CONDITIONAL among
them, as decoding compiles it (`speculative.SPEC_COMPILER_OPTIONS`),
XLA can run the loop as a graph with conditional nodes instead. `--command-buffers` times the generation as decoding
compiles it and with other settings (`spec_round`'s names); the generations are timed in turns.

Per setting, on the random-weight target (Qwen3-8B shape, 5-layer drafter, batch 1, a random
prompt of --ctx tokens): the median wall time of a whole generation of --new tokens, of the
prefill alone (`speculative.start_state`, compiled the same way), and so the decode time per
round run (`(generation - prefill) / rounds run`, where rounds run = k * ceil(rounds / k)) and per
round needed. Beside them, in the same process, `spec_round`'s 8-round call. `--method ar` times
plain AR decoding (`generate.generate_ar`, whose `while_loop` reads `done` back every token) the same
way, a round being a token. `--rest S` sleeps S seconds before each timed generation and prefill,
so that each starts below the GPU's power limit (sustained decoding runs at it).

    python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 64 --rounds-per-check 1 4 8
    python -m dflash_jax.bench.decode_loop --new 128 --rounds-per-check 1 --method ddtree dflash \
        --command-buffers decoding off all

A Qwen3.5 / Qwen3.6 hybrid shape (--model qwen3.6-27b, tiny-hybrid) times DFlash and DDTree the
same way (random hybrid weights); its AR decoding has its own loop (`qwen3_5.generate`) and is
timed by `ar_decode`, so `--method ar` refuses a hybrid.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.clocks import timed_calls
from dflash_jax.bench.common import SHAPES, environment, log, time_fn, write_json
from dflash_jax.bench.spec_round import (COMMAND_BUFFERS, add_xla_options_argument, decoding_options, decoding_pair,
                                         make_state, parse_xla_options, timed_rounds)
from dflash_jax.generate import generate_ar
from dflash_jax.qwen3_5 import Qwen35Config
from dflash_jax.impl import ATTENTION_IMPLS, Impl
from dflash_jax.speculative import _STATIC, SpecSettings, _generate, speculative_program, start_state

AR_STATIC = ("cfg", "max_new_tokens", "max_len", "sampling", "stop_tokens", "impl")


def generation_program(method: str, s: SpecSettings | None, command_buffers: str, extra: dict[str, Any] | None = None):
    """The generation as decoding compiles it ("decoding": `speculative_program(s)`, or
    `generate_ar` for method "ar", s None), or with the compile options of
    `spec_round.decoding_options` for that setting, plus `extra` XLA options."""
    if command_buffers == "decoding" and not extra:
        return generate_ar if s is None else speculative_program(s)
    options = {**decoding_options(method, command_buffers), **(extra or {})} or None
    if s is None:
        return jax.jit(generate_ar.__wrapped__, static_argnames=AR_STATIC, compiler_options=options)
    return jax.jit(_generate, static_argnames=_STATIC, compiler_options=options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="max new tokens per generation")
    ap.add_argument("--rounds-per-check", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--method", nargs="+", choices=("ddtree", "dflash", "ar"), default=["ddtree"],
                    help="DDTree (at --budget), DFlash, or plain AR decoding (`generate_ar`: a round is a "
                         "token); several: each is timed")
    ap.add_argument("--command-buffers", nargs="+", default=["decoding"],
                    choices=["decoding"] + sorted(COMMAND_BUFFERS),
                    help="XLA's command buffers for the generation: as decoding compiles it (every command type), "
                         "or as spec_round names them: off, default, all "
                         "(every type, WHILE and CONDITIONAL among them), no-loops; several: each is timed")
    add_xla_options_argument(ap, ", added to the command-buffer setting's")
    ap.add_argument("--attn-impl", nargs="+", default=["auto"], choices=ATTENTION_IMPLS,
                    help="the attention's implementations (Impl.attention), AR's included; timed in turns")
    ap.add_argument("--rest", type=float, default=0.0,
                    help="seconds idle before each timed generation and prefill (0: back to back), so that "
                         "each starts below the GPU's power limit")
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    if "ar" in args.method and isinstance(SHAPES[args.model], Qwen35Config):
        ap.error(f"--method ar: --model {args.model} is a Qwen3.5 / Qwen3.6 hybrid, whose AR decoding "
                 f"(qwen3_5.generate) decode_loop does not time; use dflash_jax.bench.ar_decode --models {args.model}")
    cfg, dcfg, dparams, target = decoding_pair(args.model)
    prompts = jax.random.randint(jax.random.key(2), (1, args.ctx), 0, cfg.vocab_size - 1, jnp.int32)
    lens = jnp.full((1,), args.ctx, jnp.int32)
    key = jax.random.key(0)
    # SpecSettings per speculative method; None for AR.
    bases = {m: None if m == "ar" else SpecSettings(method=m, budget=args.budget, block_size=dcfg.block_size,
                                                    max_new_tokens=args.new) for m in args.method}
    spec = [m for m in args.method if m != "ar"]
    max_len = -(-(args.ctx + args.new + max((bases[m].cache_slack() for m in spec), default=0)) // 128) * 128
    log("weights ready")

    def median_ms(fn) -> float:
        """fn's median wall ms: back to back (`time_fn`), or each call after `--rest` seconds idle."""
        if not args.rest:
            return time_fn(fn, warmup=1, iters=args.iters)["median_ms"]
        jax.block_until_ready(fn())
        return statistics.median(timed_calls(fn, calls=args.iters, rest_s=args.rest))

    prefills = {}
    if spec:  # the speculative methods' prefill (`start_state`), compiled as the first one decodes
        first = bases[spec[0]]
        prefill = jax.jit(lambda t, d, p, l, k: start_state(t, cfg, d, dcfg, p, l, k, max_len, first),
                          compiler_options=decoding_options(first.method) or None)
        prefills = dict.fromkeys(spec, median_ms(lambda: prefill(target, dparams, prompts, lens, key).count))
    if "ar" in args.method:  # AR's own: generate_ar up to its first token, the loop not entered
        prefills["ar"] = median_ms(lambda: generate_ar(target, cfg, prompts, lens, key, max_new_tokens=1,
                                                       max_len=max_len).tokens)
    log(f"prefill {prefills} ms")
    programs = []
    first_tokens: dict[str, Any] = {}  # by method
    combos = [(m, cb) for m in args.method for cb in args.command_buffers]
    # A setting that compiles as an earlier one of the same method (DDTree's "decoding" is "all") runs once.
    combos = [(m, cb) for i, (m, cb) in enumerate(combos)
              if all(m != m2 or decoding_options(m, cb) != decoding_options(m2, cb2) for m2, cb2 in combos[:i])]
    variants = itertools.product(combos, args.attn_impl, args.xla_options, args.rounds_per_check)
    for (method, cb), attn, xla, k in variants:
        if method == "ar" and k != args.rounds_per_check[0]:
            continue  # AR reads `done` every step
        s = bases[method]
        impl = Impl(attention=attn, rounds_per_check=1 if s is None else k)
        t0 = time.perf_counter()
        program = generation_program(method, s, cb, parse_xla_options(xla))
        # Compiled ahead of time; the static arguments are baked in.
        if s is None:
            compiled = program.lower(target, cfg, prompts, lens, key, max_new_tokens=args.new,
                                     max_len=max_len, impl=impl).compile()
            call = functools.partial(compiled, target, prompts, lens, key)
        else:
            compiled = program.lower(target, cfg, dparams, dcfg, prompts, lens, key, settings=s,
                                     max_len=max_len, impl=impl).compile()
            call = functools.partial(compiled, target, dparams, prompts, lens, key)
        gen = call()
        rounds = int(jax.device_get(gen.num_tokens).max()) - 1 if s is None else int(jax.device_get(gen.rounds).max())
        tokens = jax.device_get(gen.tokens)
        same = bool((tokens == first_tokens.setdefault(method, tokens)).all())
        setting = {"method": method, "command_buffers": cb, "attn_impl": attn,
                   "xla_options": xla, "tokens_as_first": same, "rounds_per_check": impl.rounds_per_check,
                   "rounds": rounds, "first_call_s": round(time.perf_counter() - t0, 1)}
        programs.append((setting, call))
    # Timed in turns, one generation of each per turn, so drift falls on all alike.
    times: list[list[float]] = [[] for _ in programs]
    for _ in range(args.iters):
        for i, (_, call) in enumerate(programs):
            time.sleep(args.rest)
            t0 = time.perf_counter()
            jax.block_until_ready(call().tokens)
            times[i].append((time.perf_counter() - t0) * 1e3)
    rows: list[dict[str, Any]] = []
    for (setting, _), ts in zip(programs, times):
        method, k, rounds = setting["method"], setting["rounds_per_check"], setting["rounds"]
        total = statistics.median(ts)
        run = k * math.ceil(rounds / k)
        row = {**setting, "rest_s": args.rest, "rounds_run": run,
               "generation_ms": round(total, 2), "prefill_ms": round(prefills[method], 2),
               "ms_per_round_run": round((total - prefills[method]) / run, 3),
               "ms_per_round_needed": round((total - prefills[method]) / rounds, 3),
               "generation_ms_turns": [round(t, 2) for t in ts]}
        log(row)
        rows.append(row)
    # The round benchmark's program, same weights, same context, same process, with each
    # command-buffer setting.
    bench: dict[str, float] = {}
    for method, cb in [c for c in combos if c[0] != "ar"]:
        state = make_state(cfg, dcfg, args.ctx, max_len, args.new, jnp.bfloat16)  # donated
        name = f"{method} {cb}"
        bench[name], _, _ = timed_rounds(target, dparams, cfg, dcfg, bases[method], state,
                                         decoding_options(method, cb) or None)
        log(f"spec_round's 8-round call, {name}: {bench[name]:.3f} ms a round")
    print(f"\n{env['device']}, jax {env['jax']}, {'/'.join(args.method)} (DDTree budget {args.budget}), "
          f"prompt {args.ctx}, {args.new} new tokens, "
          f"batch 1 (random weights: about one token a round)"
          + (f", each generation and prefill after {args.rest} s idle" if args.rest else ""))
    print("| method | command buffers | attention | XLA options | tokens as the method's first "
          "| rounds per check | rounds | rounds run | generation ms | prefill ms | ms / round run | ms / round needed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['command_buffers']} | {r['attn_impl']} | "
              f"{r['xla_options'] or '-'} | "
              f"{r['tokens_as_first']} | "
              f"{r['rounds_per_check']} | "
              f"{r['rounds']} | {r['rounds_run']} | "
              f"{r['generation_ms']} | {r['prefill_ms']} | {r['ms_per_round_run']} | {r['ms_per_round_needed']} |")
    for cb, ms in bench.items():
        print(f"| {cb}: spec_round (fori_loop of 8) | | auto | - | | | | | | | {ms:.3f} | |")
    if args.out:
        write_json(args.out, {"env": env, "rows": rows, "spec_round_ms": bench})


if __name__ == "__main__":
    main()
