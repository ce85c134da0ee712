"""Round latency of DFlash, DDTree and MTP (and the AR step beside them) for a Qwen3-8B-shaped target.

python -m dflash_jax.bench.spec_round --ctx 512 4096 --budgets 16 64 256 512 --out spec.json
python -m dflash_jax.bench.spec_round --model qwen3.6-27b --ctx 4096 --budgets 16 64 256 --prefill 4096 32768
python -m dflash_jax.bench.spec_round --model qwen3.6-27b --ctx 4096 --budgets 64 --mtp-steps 1 2 3 4 --mtp-budgets 16

`--mtp-steps K...` adds a round of a random MTP head (`dflash_jax.mtp`, the head's shape for the
target: one full-attention layer of the target's kind) drafting K chained steps as a chain, and
`--mtp-budgets B...` a tree of the most steps with B nodes, both at every --ctx: draft (the K
steps), verify, accept and commit (the target's and the head's entries of the accepted path).

Random bf16 weights: the target has Qwen3-8B's shape, the drafter 5 layers of the same width
(z-lab's drafters for Qwen3-8B have this shape). Each number is the median wall time per round
of a jitted, donated call that runs 8 rounds (or AR steps) in an on-device loop, as decoding
does, after warm-up (compile excluded). The split by stage (draft, tree, verify, accept,
commit: named scopes in `spec_round`) comes from a profiler trace of that same program; on GPU
it needs XLA command buffers off (XLA_FLAGS=--xla_gpu_enable_command_buffer=), which hide
per-instruction attribution, so a profiled round compiles them off where decoding has them on for
every command type (`--no-profile` times it as decoding compiles it; the two time about the same
here, where the loop's trip count is known and nothing is read back). For each
stage as its own program on real prompts, see `dflash_jax.stage_times` (`dflash-jax generate
--stage-times`).

A Qwen3.5 / Qwen3.6 hybrid shape (qwen3.6-27b, tiny-hybrid) runs the same rounds: `spec_round`
dispatches verify and commit (the GDN states rolled back to the accepted path) on the config, so
the same scopes split them; the state at ctx holds random K/V in the attention layers and random
conv and recurrent states in the GDN layers, the AR step is `qwen3_5.forward` on one token, and
--attn-impl picks the attention layers' core as for a dense target. The profile splits a hybrid's
verify further by the target's mixer scopes (verify/attention, verify/gdn; the rest is MLPs, norms
and the LM head), and the report puts the GDN layers' share of the verify time beside their share
of the weight bytes a verify reads (`weight_shares`). `--prefill N...`
times the target's prefill (the one pass `speculative.start_state` makes) over N random tokens,
dense or hybrid, and reports tokens/s; a length that does not fit in memory is reported and
skipped.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import math
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from dflash_jax import drafter as dr
from dflash_jax import mtp
from dflash_jax import qwen3_5
from dflash_jax.bench.ar_decode import layer_buffers, make_decoder, random_cache, random_hybrid_cache
from dflash_jax.bench.clocks import ClockSampler
from dflash_jax.bench.common import SHAPES, dump_hlo, environment, log, time_fn, write_json
from dflash_jax.bench.profile import profile_program, scale_profile
from dflash_jax.config import default_tap_layers
from dflash_jax.impl import ATTENTION_IMPLS, Impl
from dflash_jax.kv_cache import KVCache
from dflash_jax.model import init_params
from dflash_jax.params import Spec
from dflash_jax.qwen3_5 import HybridCache, Qwen35Config
from dflash_jax.speculative import (COMMAND_BUFFERS_ALL, COMMAND_BUFFERS_OFF, DOT_MERGER_OFF, SpecSettings, SpecState,
                                   spec_round, target_family)
from dflash_jax.stage_times import STAGES  # the round's named scopes

# The hybrid target's mixer scopes (`qwen3_5._run_layers`); inside a round only the verify runs them.
MIXER_SCOPES = (qwen3_5.ATTENTION_SCOPE, qwen3_5.GDN_SCOPE)
# The bar a hybrid's verify is held to: the GDN layers' share of its time at most their share of
# the weight bytes it reads plus 20 percentage points (a memory-bound verify spends time as bytes).
GDN_SHARE_SLACK = 0.20


def drafter_config(cfg, layers: int = 5, block_size: int = 16) -> dr.DraftConfig:
    return dr.DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                          num_layers=layers, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                          head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, mask_token_id=cfg.vocab_size - 1,
                          target_layer_ids=default_tap_layers(cfg.num_layers, layers),
                          num_target_layers=cfg.num_layers, block_size=block_size, rms_norm_eps=cfg.rms_norm_eps,
                          rope=cfg.rope, max_position_embeddings=cfg.max_position_embeddings)


def target_shape(model: str):
    """SHAPES[model]: a dense ModelConfig or a hybrid Qwen35Config; an unknown name is refused."""
    if model not in SHAPES:
        raise ValueError(f"--model: unknown model shape {model!r}; known: {sorted(SHAPES)}")
    return SHAPES[model]


def init_target(cfg, key: jax.Array, dtype):
    """Random target weights of cfg's family (`model.init_params` or `qwen3_5.init_params`)."""
    init = qwen3_5.init_params if isinstance(cfg, Qwen35Config) else init_params
    return jax.block_until_ready(init(cfg, key, dtype))


def decoding_pair(model: str, dtype=jnp.bfloat16) -> tuple[Any, dr.DraftConfig, Any, Any]:
    """(cfg, dcfg, drafter params, target params) with random weights in the decoding layout (the
    target fused, the drafter block-qkv), as `spec_round`'s defaults time them: the `SHAPES[model]`
    target (dense or hybrid) and a 5-layer drafter."""
    cfg = target_shape(model)
    dcfg = drafter_config(cfg)
    dparams = dr.init_draft_params(dcfg, jax.random.key(1), dtype)
    return cfg, dcfg, dparams, init_target(cfg, jax.random.key(0), dtype)


def random_target_cache(cfg, max_len: int, ctx: int, dtype) -> KVCache | HybridCache:
    """Batch 1, `ctx` tokens committed: random K/V, and for a hybrid random GDN conv and recurrent
    states too (a round's rollback then works on states of a real state's scale, not zeros)."""
    if not isinstance(cfg, Qwen35Config):
        return random_cache(cfg, 1, max_len, ctx, dtype)
    cache = random_hybrid_cache(cfg, 1, max_len, ctx, dtype)
    keys = jax.random.split(jax.random.key(6), 2 * len(cache.conv)).reshape(2, -1)
    conv = tuple(jax.random.normal(k, c.shape, c.dtype) for k, c in zip(keys[0], cache.conv))
    # A recurrent state sums rank-one updates beta v k^T with unit-norm k: entries of v's scale / sqrt(dk).
    state = tuple(jax.random.normal(k, s.shape, s.dtype) * cfg.gdn_key_dim ** -0.5 for k, s in zip(keys[1], cache.state))
    return dataclasses.replace(cache, conv=conv, state=state)


def make_state(cfg, dcfg, ctx: int, max_len: int, max_new: int, dtype=jnp.bfloat16) -> SpecState:
    """Batch 1 at `ctx` committed tokens: a random target cache, and a random drafter context (a
    DFlash drafter's) or a random MTP head cache (`dcfg` an `mtp.MTPConfig`; ctx - 1 entries)."""
    cache = random_target_cache(cfg, max_len, ctx, dtype)
    if isinstance(dcfg, mtp.MTPConfig):
        (hk,), (hv,) = layer_buffers(jax.random.key(5), (1, max_len, cfg.num_kv_heads, cfg.head_dim), 1, dtype)
        hidden = jax.random.normal(jax.random.key(7), (1, cfg.hidden_size), dtype)
        dcache = mtp.MTPCache(k=hk, v=hv, lengths=jnp.full((1,), ctx - 1, jnp.int32), hidden=hidden)
    else:
        dk, dv = layer_buffers(jax.random.key(5), (1, max_len, dcfg.num_kv_heads, dcfg.head_dim), dcfg.num_layers,
                               dtype)
        dcache = dr.DraftCache(k=dk, v=dv, lengths=jnp.full((1,), ctx, jnp.int32))
    return SpecState(cache=cache, draft_cache=dcache, root=jnp.full((1,), 11, jnp.int32),
                     out=jnp.zeros((1, max_new), jnp.int32), count=jnp.ones((1,), jnp.int32),
                     done=jnp.zeros((1,), bool), accepted=jnp.zeros((1, max_new), jnp.int32),
                     rounds=jnp.zeros((1,), jnp.int32), key=jax.random.key(0))


def weight_shares(cfg: Qwen35Config) -> dict[str, float]:
    """Shares of the weight bytes a hybrid's verify reads, by kind (from `qwen3_5.model_specs`,
    all weights in one dtype): "gdn" (the GDN mixers), "attention" (the gated attention mixers),
    "rest" (MLPs, norms, the LM head). An untied embedding table is left out: the verify gathers
    W of its rows, not the table."""
    specs = qwen3_5.model_specs(cfg)

    def size(tree: Any) -> int:
        return sum(math.prod(s.shape) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Spec)))
    gdn, attn = size(specs.gdn), size(specs.attn)
    rest = size(specs.layers) + size(specs.final_norm) + size(specs.lm_head if specs.lm_head is not None
                                                               else specs.embed)
    total = gdn + attn + rest
    return {"gdn": gdn / total, "attention": attn / total, "rest": rest / total}


def split_verify(by_scope: dict[str, float]) -> dict[str, float]:
    """A hybrid round's profile split with the mixer scopes: their time ("attention", "gdn", the
    innermost scope of their ops) becomes "verify/attention" and "verify/gdn", and "verify" the
    whole verify again (its mixers plus the rest)."""
    out = dict(by_scope)
    parts = {f"verify/{k}": out.pop(k) for k in MIXER_SCOPES if k in out}
    if parts:
        out["verify"] = out.get("verify", 0.0) + sum(parts.values())
        out.update(parts)
    return out


def gdn_verify_share(row: dict, cfg: Qwen35Config) -> dict[str, float] | None:
    """`GDN_SHARE_SLACK`'s bar for a hybrid row with a profile: the GDN layers' share of the verify time
    against their share of the weight bytes (`weight_shares`); None without the split."""
    split = (row.get("profile") or {}).get("by_scope", {})
    if not split.get("verify") or "verify/gdn" not in split:
        return None
    time_share = split["verify/gdn"] / split["verify"]
    bytes_share = weight_shares(cfg)["gdn"]
    return {"time": time_share, "bytes": bytes_share, "goal_met": time_share <= bytes_share + GDN_SHARE_SLACK}


def reset(state: SpecState, ctx: Any) -> SpecState:
    """Rounds with random weights commit ~1 token; put the lengths back so every round sees ctx.

    ctx: an int, or the [batch] lengths to restore.
    """
    lengths = jnp.full_like(state.cache.lengths, ctx)
    behind = 1 if isinstance(state.draft_cache, mtp.MTPCache) else 0  # an MTP head holds one entry fewer
    return dataclasses.replace(state, cache=dataclasses.replace(state.cache, lengths=lengths),
                               draft_cache=dataclasses.replace(state.draft_cache, lengths=lengths - behind),
                               count=jnp.ones_like(state.count), rounds=jnp.zeros_like(state.rounds),
                               done=jnp.zeros_like(state.done))


ROUNDS_PER_CALL = 8


@functools.lru_cache(maxsize=None)
def round_program(cfg, dcfg, s: SpecSettings, rounds: int = ROUNDS_PER_CALL, impl: Impl = Impl()):
    """`rounds` fused rounds in one jitted, donated `fori_loop`, each from the lengths it was given.

    Decoding runs its rounds inside one on-device loop (`generate_speculative`), so this is the
    latency a round has there: no per-round host dispatch. The context is data, so one compile
    serves every context of a settings. impl: the attention's implementation (`Impl.attention`).
    """
    def run(state: SpecState, start: jax.Array, target, dparams) -> SpecState:
        body = lambda _, st: spec_round(reset(st, start), target, cfg, dparams, dcfg, s, impl)  # noqa: E731
        return reset(jax.lax.fori_loop(0, rounds, body, state), start)
    # `start` is its own argument, not read from the donated state: on GPU (jax 0.11.2), reading
    # the donated state's lengths and writing them back after the loop returned garbage lengths.
    return jax.jit(run, donate_argnums=(0,))


def timed_rounds(target, dparams, cfg, dcfg, s: SpecSettings, state: SpecState,
                 compiler_options: dict[str, Any] | None = None, rounds: int = ROUNDS_PER_CALL,
                 impl: Impl = Impl()) -> tuple[float, Any, Callable[[], jax.Array]]:
    """Median ms per round of the fused, donated round (`rounds` a call), every round starting at
    `state`'s lengths.

    Returns (ms, the compiled program, a call that runs it once more on the carried state) so
    callers can read its HLO (`.as_text()`) and profile it. `compiler_options` go to XLA as they are.
    """
    ms, rnd, call, _ = _timed_rounds(target, dparams, cfg, dcfg, s, state, profile=False, rounds=rounds,
                                     compiler_options=compiler_options, impl=impl)
    return ms, rnd, call


# XLA's DotMerger joins dots that share an input by concatenating their weights, and at wide
# trees it does so for q/k/v inside the round loop: a 48 MB copy per layer every round (Qwen3-8B).
# Threshold 0 turns the pass off; `--dot-merger default off` times both in one process.
# Speculative decoding compiles with the pass off (speculative.SPEC_COMPILER_OPTIONS).
DOT_MERGER = {"default": {}, "off": DOT_MERGER_OFF}
# XLA's command buffers (CUDA graphs) as they are, off, or for every command type XLA can put in
# a graph, loops and custom calls included, in graphs of any size ("all": as speculative decoding
# compiles them, speculative.SPEC_COMPILER_OPTIONS; whether that captures the whole round depends
# on what each custom call allows); "no-loops" the same without WHILE and CONDITIONAL.
# `--command-buffers default off all` times them in one process.
COMMAND_BUFFERS = {"default": {}, "off": COMMAND_BUFFERS_OFF, "all": COMMAND_BUFFERS_ALL,
                   "no-loops": {**COMMAND_BUFFERS_ALL,
                                "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"}}


def decoding_settings(method: str, dot_merger: str = "decoding", command_buffers: str = "decoding",
                      profile: bool = False) -> tuple[str, str]:
    """(dot merger, command buffers) by their names in DOT_MERGER / COMMAND_BUFFERS, "decoding"
    resolved as decoding compiles `method` ("ddtree", "dflash" or "mtp": speculative.SPEC_COMPILER_OPTIONS;
    "ar", `generate.generate_ar`: generate.COMMAND_BUFFERS_ALL). A profile
    cannot see into graphs, and spec_round's fori_loop times about the same with or without them
    (BENCHMARKS.md), so with `profile` a program compiles them off."""
    if dot_merger == "decoding":
        dot_merger = "default" if method == "ar" else "off"
    if command_buffers == "decoding":
        command_buffers = "off" if profile else "all"
    return dot_merger, command_buffers


def decoding_options(method: str, command_buffers: str = "decoding") -> dict[str, Any]:
    """The compile options of `decoding_settings` for an unprofiled program."""
    dot_merger, command_buffers = decoding_settings(method, command_buffers=command_buffers)
    return {**DOT_MERGER[dot_merger], **COMMAND_BUFFERS[command_buffers]}


def _timed_rounds(target, dparams, cfg, dcfg, s, state, profile: bool, rounds: int = ROUNDS_PER_CALL,
                  compiler_options: dict[str, Any] | None = None, table: int = 0, timeline: bool = False,
                  clocks: bool = False, impl: Impl = Impl()):
    # Compiled ahead of time: the same executable is timed and profiled, and its HLO is at hand.
    t0 = time.perf_counter()
    start = jnp.array(state.cache.lengths)  # a copy: the state is donated
    rnd = round_program(cfg, dcfg, s, rounds, impl).lower(state, start, target=target, dparams=dparams).compile(
        compiler_options=compiler_options)
    compile_s = time.perf_counter() - t0
    box = {"state": state}

    def call_rounds():
        box["state"] = rnd(box["state"], start, target=target, dparams=dparams)
        return box["state"].count
    with ClockSampler() if clocks else contextlib.nullcontext() as sampler:
        t = time_fn(call_rounds, warmup=2, iters=10)
    where = None
    if profile:
        hybrid = isinstance(cfg, Qwen35Config)
        where = scale_profile(profile_program(call_rounds, rnd.as_text(), calls=3,
                                              scopes=STAGES + (MIXER_SCOPES if hybrid else ()), table=table,
                                              timeline=timeline),
                              rounds)
        if hybrid and "by_scope" in where:
            where["by_scope"] = split_verify(where["by_scope"])
    # Random weights can overflow to inf/NaN; say so, since such values would void the timing's realism.
    cache = box["state"].cache
    finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (cache.k[-1], cache.v[-1]))
    extra = {"compile_s": compile_s, "rounds_per_call": rounds, "profile": where, "kv_finite": finite}
    if isinstance(cache, HybridCache):  # the GDN states the commit rolled back
        extra["gdn_state_finite"] = all(bool(jnp.isfinite(x.astype(jnp.float32)).all())
                                        for x in cache.state + cache.conv)
    if clocks:
        extra["clocks"] = sampler.summary
    return t["median_ms"] / rounds, rnd, call_rounds, extra


def bench_settings(target, cfg, dparams, dcfg, s: SpecSettings, ctx: int, max_len: int, profile: bool,
                   hlo_dir: str | None = None, rounds: int = ROUNDS_PER_CALL, dot_merger: str = "decoding",
                   table: int = 0, command_buffers: str = "decoding", xla_options: str = "",
                   timers: list | None = None, timeline: bool = False, clocks: bool = False,
                   impl: Impl = Impl()) -> dict:
    state = make_state(cfg, dcfg, ctx, max_len, s.max_new_tokens, target.embed.dtype)
    dot_merger, command_buffers = decoding_settings(s.method, dot_merger, command_buffers, profile)
    options = {**DOT_MERGER[dot_merger], **COMMAND_BUFFERS[command_buffers], **parse_xla_options(xla_options)} or None
    ms, rnd, call, extra = _timed_rounds(target, dparams, cfg, dcfg, s, state, profile, rounds, options, table,
                                         timeline, clocks, impl)
    dump_hlo(hlo_dir, f"round_{s.method}{s.mtp_steps or ''}_b{s.budget}_ctx{ctx}_r{rounds}_dm-{dot_merger}"
                      f"_cb-{command_buffers}"
                      f"_{impl.attention}_w{s.width}"
                      f"{'_xla-' + re.sub(r'[^A-Za-z0-9]+', '-', xla_options) if xla_options else ''}", rnd.as_text())
    row = {"method": s.method if s.method != "mtp" else f"mtp(k={s.mtp_steps})", "budget": s.budget,
           "width": s.width, "ctx": ctx, "round_ms": ms,
           "dot_merger": dot_merger, "command_buffers": command_buffers, "xla_options": xla_options,
           "attn_impl": impl.attention, **extra}
    if isinstance(cfg, Qwen35Config):
        row["gdn_share"] = gdn_verify_share(row, cfg)
    log(row)
    if timers is not None:  # kept compiled, with its state, for `interleaved_medians`
        timers.append((row, call, rounds))
    return row


def interleaved_medians(timers: list, repeats: int, iters: int = 5) -> None:
    """Times every kept variant again, taking turns (A B C A B C ...) `repeats` times, so that
    clock and thermal drift over the run falls on all of them alike; each row gets
    round_ms_interleaved (the median of its turns' medians) and the turns themselves."""
    turns: dict[int, list[float]] = {i: [] for i in range(len(timers))}
    for _ in range(repeats):
        for i, (_, call, rounds) in enumerate(timers):
            turns[i].append(time_fn(call, warmup=1, iters=iters)["median_ms"] / rounds)
    for i, (row, _, _) in enumerate(timers):
        row["round_ms_interleaved"] = statistics.median(turns[i])
        row["round_ms_turns"] = [round(t, 4) for t in turns[i]]
        log({"interleaved": row["round_ms_interleaved"], "method": row["method"], "width": row["width"],
             "attn_impl": row["attn_impl"], "xla_options": row["xla_options"],
             "draft_layout": row.get("draft_layout")})


def bench_ar(target, cfg, ctx: int, max_len: int, profile: bool, table: int = 0) -> dict:
    """AR decode steps (the W=1 forward; `qwen3_5.forward` for a hybrid) from `ctx` tokens in one
    on-device loop, as decoding runs."""
    cache = random_target_cache(cfg, max_len, ctx, target.embed.dtype)
    tok = jnp.full((1,), 3, jnp.int32)
    t0 = time.perf_counter()
    steps = _ar_decoder(cfg).lower(target, cache, tok).compile()
    compile_s = time.perf_counter() - t0
    box = {"cache": cache}

    def call():
        box["cache"], t = steps(target, box["cache"], tok)
        return t
    t = time_fn(call, warmup=2, iters=10)
    row = {"method": "ar", "ctx": ctx, "round_ms": t["median_ms"] / ROUNDS_PER_CALL,
           "compile_s": compile_s, "rounds_per_call": ROUNDS_PER_CALL}
    if profile:  # a hybrid's step split by its mixer scopes ("attention", "gdn"; the rest "other")
        scopes = MIXER_SCOPES if isinstance(cfg, Qwen35Config) else ()
        row["profile"] = scale_profile(profile_program(call, steps.as_text(), calls=3, scopes=scopes, table=table),
                                       ROUNDS_PER_CALL)
    log(row)
    return row


def bench_prefill(target, cfg, dcfg, tokens: int) -> dict:
    """The target's prefill of one random prompt of `tokens` tokens, as `speculative.start_state`
    runs it (`target_family(cfg).prefill`, the drafter's taps included, into a fresh cache of
    tokens + 64 slots); compile excluded. A length whose program fails (out of memory) gives a row
    with the error instead of stopping the run."""
    prompts = jax.random.randint(jax.random.key(3), (1, tokens), 0, cfg.vocab_size - 1, jnp.int32)
    lens = jnp.full((1,), tokens, jnp.int32)
    family, taps = target_family(cfg), tuple(dcfg.target_layer_ids)
    run = jax.jit(lambda t, p, n: family.prefill(t, cfg, p, n, tokens + 64, taps, Impl()))
    row: dict[str, Any] = {"method": "prefill", "ctx": tokens}
    try:
        t0 = time.perf_counter()
        compiled = run.lower(target, prompts, lens).compile()
        row["compile_s"] = time.perf_counter() - t0
        t = time_fn(lambda: compiled(target, prompts, lens), warmup=1, iters=3)
        logits = compiled(target, prompts, lens)[0]
    except Exception as err:  # noqa: BLE001 - e.g. RESOURCE_EXHAUSTED at a long prompt; the other lengths go on
        row["error"] = repr(err)[:400]
        log(row)
        return row
    row.update(prefill_ms=t["median_ms"], tokens_per_s=tokens / (t["median_ms"] * 1e-3),
               logits_finite=bool(jnp.isfinite(logits).all()))
    log(row)
    return row


@functools.lru_cache(maxsize=None)
def _ar_decoder(cfg):
    """ar_decode's greedy step loop, ROUNDS_PER_CALL steps; one compile serves every context."""
    return make_decoder(cfg, ROUNDS_PER_CALL, "auto")


def _idle(prof: dict) -> str:
    if "gap_ms" not in prof:
        return "-"
    parts = ", ".join(f"{k} {v:.2f}" for k, v in prof.get("gap_by_scope", {}).items() if v >= 0.005)
    return f"{prof['gap_ms']:.2f} ({parts})"


def parse_xla_options(text: str) -> dict[str, Any]:
    """--xla-options value: "" (none) or KEY=VALUE[,KEY=VALUE...] compile options for XLA
    (true/false become bools, integers ints, anything else stays a string; a value may hold
    commas, e.g. xla_gpu_enable_command_buffer=FUSION,CUBLAS)."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*=)", text))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--xla-options takes KEY=VALUE items, got {item!r} in {text!r}")
        low = value.lower()
        options[key] = low == "true" if low in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
    return options


def _checked_xla_options(text: str) -> str:
    parse_xla_options(text)
    return text


def add_xla_options_argument(ap: argparse.ArgumentParser, note: str = "") -> None:
    """The benches' --xla-options: XLA compile options per variant, each checked as it is read;
    `note` says more about them in the help."""
    ap.add_argument("--xla-options", nargs="+", type=_checked_xla_options, default=[""],
                    help="extra XLA compile options per variant, KEY=VALUE[,KEY=VALUE...] ('' for none)"
                         f"{note} (several: each is timed, side by side)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--ctx", nargs="*", type=int, default=[512, 4096], help="AR and DFlash contexts (none: DDTree only)")
    ap.add_argument("--budgets", nargs="*", type=int, default=[16, 64, 256, 512])
    ap.add_argument("--ddtree-ctx", type=int, default=4096)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--draft", help="a drafter directory or shipped name instead of a random 5-layer one")
    ap.add_argument("--no-profile", action="store_true", help="no per-stage split (from a profiler trace)")
    ap.add_argument("--dump-hlo", metavar="DIR", help="write each compiled round's HLO here (gzip)")
    ap.add_argument("--dot-merger", nargs="+", choices=sorted(DOT_MERGER) + ["decoding"], default=["decoding"],
                    help="XLA's dot merger as decoding compiles it (off for DDTree, as is for DFlash), "
                         "as is, or off (several: each is timed, side by side)")
    ap.add_argument("--attn-impl", nargs="+", choices=ATTENTION_IMPLS, default=["auto"],
                    help="the target's attention (Impl.attention): as dispatched (auto/pallas: the Hopper "
                         "kernel on sm_90 where it applies, fed by the fused qkv epilogue), the Triton kernel "
                         "alone as GPUs other than Hopper run it (triton), or jnp (reference, which keeps the "
                         "whole round in XLA) (several: each is timed, side by side)")
    ap.add_argument("--rounds-per-call", nargs="+", type=int, default=[ROUNDS_PER_CALL],
                    help="rounds per jitted call (several: each is timed, side by side)")
    ap.add_argument("--command-buffers", nargs="+", choices=sorted(COMMAND_BUFFERS) + ["decoding"],
                    default=["decoding"],
                    help="XLA's command buffers (CUDA graphs) as decoding compiles them (every command type; "
                         "off where the round is profiled), as they are, off, every command type (all), or "
                         "all but the loop types (no-loops) (several: each is timed, side by side)")
    add_xla_options_argument(ap, ", e.g. xla_gpu_enable_pdl=false; a variant whose compile fails is reported and "
                                 "skipped")
    ap.add_argument("--interleave", type=int, default=0, metavar="R",
                    help="after all variants: time them again in turns, R rounds of turns, and report each "
                         "one's median (round_ms_interleaved: drift falls on all alike; keeps every "
                         "variant's program and state in memory until then)")
    ap.add_argument("--kernel-table", type=int, default=0, metavar="N",
                    help="with the profile: also list the N costliest kernels (launches, kind, op)")
    ap.add_argument("--timeline", action="store_true",
                    help="with the profile: also keep one traced call's kernels in order (start, duration, "
                         "idle before, scope, name, op) in each DDTree row")
    ap.add_argument("--clocks", action="store_true",
                    help="sample the SM clock, power and throttle reasons (nvidia-smi, every 50 ms) while each "
                         "DDTree row is timed, and keep their medians in the row (bench/clocks.py)")
    ap.add_argument("--prefill", nargs="*", type=int, default=[], metavar="N",
                    help="also time the target's prefill of N random tokens (tokens/s; several: each)")
    ap.add_argument("--mtp-steps", nargs="*", type=int, default=[],
                    help="MTP chain rounds of a random head with these chained steps, at every --ctx")
    ap.add_argument("--mtp-budgets", nargs="*", type=int, default=[],
                    help="MTP tree rounds (the most --mtp-steps) with these node budgets, at every --ctx")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.mtp_budgets and not args.mtp_steps:
        ap.error("--mtp-budgets needs --mtp-steps (the tree's depth is the most steps)")
    env = environment()
    print(env, flush=True)
    cfg = target_shape(args.model)
    dtype = jnp.dtype(args.dtype)
    if args.draft:  # a real drafter's shape and weights (the target stays random: timing only)
        from convert.dflash_drafter import load_drafter  # imports gguf; only this option needs it
        from convert.shipped import DFLASH, resolve_shipped
        dcfg, dparams = load_drafter(resolve_shipped(args.draft, DFLASH, "--draft"), dtype)
        dr.validate_pair(dcfg, cfg)
    else:
        dcfg = drafter_config(cfg)
        dparams = jax.block_until_ready(dr.init_draft_params(dcfg, jax.random.key(1), dtype))
    drafters = {"decoding": dparams}
    log("drafter weights ready")
    max_len = max(args.ctx + [args.ddtree_ctx]) + 1024
    profile = not args.no_profile

    mtp_cfg = mtp.MTPConfig(cfg) if args.mtp_steps else None
    mtp_params = (jax.block_until_ready(mtp.init_mtp_params(cfg, jax.random.key(2), dtype)) if args.mtp_steps
                  else None)

    def variants(**method):
        """Every side-by-side variant of one method: attention impl x rounds per call x dot merger x
        command buffers x XLA options."""
        s = SpecSettings(block_size=dcfg.block_size, max_new_tokens=512, **method)
        for ai, r, dm, cb, xo in itertools.product(args.attn_impl, args.rounds_per_call, args.dot_merger,
                                                   args.command_buffers, args.xla_options):
            yield s, Impl(attention=ai), r, dm, cb, xo

    timers: list | None = [] if args.interleave > 0 else None

    def bench_or_report(*a, **kw) -> dict | None:
        """bench_settings, or None after logging why a variant failed (an unknown XLA option)."""
        try:
            return bench_settings(*a, **kw, timers=timers)
        except Exception as err:  # noqa: BLE001 - one variant must not stop the others
            log({"variant_failed": repr(err)[:400], "xla_options": kw.get("xla_options")})
            return None

    rows: list[dict] = []
    prefills: list[dict] = []  # their own table: a prefill is no round
    target = init_target(cfg, jax.random.key(0), dtype)
    log("target weights drawn")
    for ctx in args.ctx:
        rows.append(bench_ar(target, cfg, ctx, max_len, profile, args.kernel_table))
        for (s, impl, r, dm, cb, xo), (dl, dp) in itertools.product(variants(method="dflash"), drafters.items()):
            row = bench_or_report(target, cfg, dp, dcfg, s, ctx, max_len, profile, args.dump_hlo, r,
                                  dm, args.kernel_table, cb, xla_options=xo, impl=impl)
            if row:
                row["draft_layout"] = dl
                rows.append(row)
        mtp_methods = ([dict(method="mtp", mtp_steps=k) for k in args.mtp_steps]
                       + [dict(method="mtp", mtp_steps=max(args.mtp_steps), budget=b) for b in args.mtp_budgets])
        for method in mtp_methods:
            for s, impl, r, dm, cb, xo in variants(**method):
                row = bench_or_report(target, cfg, mtp_params, mtp_cfg, s, ctx, max_len, profile, args.dump_hlo,
                                      r, dm, args.kernel_table, cb, xla_options=xo, impl=impl)
                if row:
                    row["draft_layout"] = "mtp"
                    rows.append(row)
    for b in args.budgets:
        for (s, impl, r, dm, cb, xo), (dl, dp) in itertools.product(variants(method="ddtree", budget=b),
                                                                    drafters.items()):
            row = bench_or_report(target, cfg, dp, dcfg, s, args.ddtree_ctx, max_len, profile,
                                  args.dump_hlo, r, dm, args.kernel_table, cb, xla_options=xo,
                                  timeline=args.timeline, clocks=args.clocks, impl=impl)
            if row:
                row["draft_layout"] = dl
                rows.append(row)
    for row in rows:
        row["layout"] = "decoding"
    if timers:  # the kept programs, timed in turns
        interleaved_medians(timers, args.interleave)
        timers.clear()
    for n in args.prefill:
        prefills.append(bench_prefill(target, cfg, dcfg, n))
    write_json(args.out, {"env": env, "rows": rows, "prefill": prefills})
    print(f"\n{env['device']}, jax {env['jax']}, {args.model} target + {dcfg.num_layers}-layer drafter, "
          f"{dtype.name}, batch 1")
    print_rounds(rows)
    if isinstance(cfg, Qwen35Config):
        print_hybrid_split(rows, cfg)
    for r in prefills:
        print(f"prefill {r['ctx']} tokens: " + (f"{r['prefill_ms']:.2f} ms, {r['tokens_per_s']:.0f} tokens/s"
                                                if "error" not in r else f"failed: {r['error']}"))


def print_hybrid_split(rows: list[dict], cfg: Qwen35Config) -> None:
    """A hybrid's verify (an AR step's forward) split into its attention and GDN layers, and the GDN
    layers' share of that time beside their share of the weight bytes (goal: <= bytes + 20 points)."""
    shares = weight_shares(cfg)
    print("weight bytes a verify reads: " + ", ".join(f"{k} {v:.1%}" for k, v in shares.items()))
    print("| method | budget | W | attention | verify ms | attention ms | gdn ms | rest ms | GDN share of time "
          "| GDN share of bytes | goal met |")
    print("|---" * 11 + "|")
    for r in rows:
        split = (r.get("profile") or {}).get("by_scope", {})
        if r["method"] == "ar":  # the whole step is the target's forward
            attn, gdn = split.get(MIXER_SCOPES[0]), split.get(MIXER_SCOPES[1])
            total = (r.get("profile") or {}).get("device_ms")
        else:
            attn, gdn, total = split.get("verify/attention"), split.get("verify/gdn"), split.get("verify")
        if attn is None or gdn is None or not total:
            continue
        time_share = gdn / total
        print(f"| {r['method']} | {r.get('budget', '-')} | {r.get('width', 1)} | {r.get('attn_impl', 'auto')} | "
              f"{total:.2f} | {attn:.2f} | {gdn:.2f} | {total - attn - gdn:.2f} | {time_share:.1%} | "
              f"{shares['gdn']:.1%} | {'yes' if time_share <= shares['gdn'] + GDN_SHARE_SLACK else 'no'} |")


def print_rounds(rows: list[dict]) -> None:
    """The rounds' table (none: nothing), then interleaved medians and idle gaps where rows have them."""
    if not rows:
        return
    print("| method | budget | W | ctx | layout | draft layout | rounds/call | dot merger | command buffers | XLA options "
          "| attention | round ms | device ms | draft | tree | verify | accept | commit | other "
          "| idle ms (by stage that waited) |")
    print("|---" * 20 + "|")
    for r in rows:
        prof = r.get("profile") or {}
        split = prof.get("by_scope", {})
        cells = [f"{split[k]:.2f}" if k in split else "-" for k in STAGES + ("other",)]
        dev = f"{prof['device_ms']:.2f}" if "device_ms" in prof else "-"
        print(f"| {r['method']} | {r.get('budget', '-')} | {r.get('width', 1)} | {r['ctx']} | {r['layout']} | {r.get('draft_layout', '-')} | "
              f"{r['rounds_per_call']} | {r.get('dot_merger', '-')} | {r.get('command_buffers', '-')} | "
              f"{r.get('xla_options') or '-'} | "
              f"{r.get('attn_impl', 'auto')} | {r['round_ms']:.2f} | "
              f"{dev} | " + " | ".join(cells) + f" | {_idle(prof)} |")
    for r in rows:
        if "round_ms_interleaved" in r:
            print(f"interleaved {r['method']} W {r.get('width', 1)} {r.get('attn_impl', '')} "
                  f"draft layout {r.get('draft_layout', '-')} "
                  f"{r.get('xla_options') or '-'} rounds/call {r['rounds_per_call']}: {r['round_ms_interleaved']:.3f} ms "
                  f"(turns {r['round_ms_turns']})")
    for r in rows:  # how each row's idle time is made (bench.profile.gap_sizes)
        sizes = (r.get("profile") or {}).get("gap_sizes")
        if sizes:
            print(f"gaps {r['method']} W {r.get('width', 1)} {r.get('xla_options') or ''}: " + ", ".join(
                f"{k}: {n:.0f} x = {ms:.3f} ms" for k, (n, ms) in sizes["buckets"].items())
                  + f"; largest: {sizes['largest'][:4]}")
        for n, ms, mean, before, waited, scope in (r.get("profile") or {}).get("gap_pairs", [])[:10]:
            print(f"  gap {scope}: {before} -> {waited}: {n:.1f} x {mean:.2f} us = {ms:.3f} ms")


if __name__ == "__main__":
    main()
