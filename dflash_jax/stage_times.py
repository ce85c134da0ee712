"""Per-stage device time of speculative rounds, each stage run as its own jitted program.

The fused round (`speculative.spec_round`, looped on device by `generate_speculative`) is the fast
path and stays untouched. This is its diagnostic twin: it prefills real prompts, then runs real
rounds stage by stage, waiting for each stage, and reports the median milliseconds per stage
with compile excluded. A stage launched on its own pays dispatch and launch costs that the fused
loop does not pay, so the stages add up to more than one fused round. For the split of the fused
program itself, profile it (`dflash_jax/bench/profile.py`).

Stages (DESIGN.md, "The round"):
- draft: the drafter pass;
- tree: the chain or the best-`budget` tree;
- verify: the target over the tree;
- accept: the walk or the rejection sampling;
- commit: K/V compaction, drafter context, emitted tokens.

On a hybrid target (`qwen3_5`) the verify is also split by kind of layer (`StageTimes.verify_parts`):
"attention" (the gated attention mixers), "gdn" (the Gated DeltaNet mixers) and "rest" (MLPs,
norms, the embedding and the LM head). The mixers run inside one layer scan, so they are not
timed as programs of their own: a profiler trace of the verify's program on the last timed
round's inputs gives each named mixer scope's share of its device time (`bench.profile`), and
each part is that share of the verify's median wall time, so the three parts sum to the verify.
The traced program is compiled with XLA's command buffers off (a trace cannot see into a CUDA
graph); its kernels are the timed program's, which command buffers only launch as one graph.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any, Callable

import jax

from dflash_jax.bench.profile import profile_program
from dflash_jax.config import ModelConfig
from dflash_jax.generate import COMMAND_BUFFERS_OFF
from dflash_jax.impl import Impl
from dflash_jax.model import ModelParams
from dflash_jax.qwen3_5 import ATTENTION_SCOPE, GDN_SCOPE, Qwen35Config
from dflash_jax.speculative import (SpecSettings, SpecState, accept_stage, commit_stage, drafter_pass,
                                    propose, start_state, verify_stage)

STAGES = ("draft", "tree", "verify", "accept", "commit")
# A hybrid verify's parts (`StageTimes.verify_parts`): the two mixer scopes, then all else.
VERIFY_PARTS = (ATTENTION_SCOPE, GDN_SCOPE, "rest")


@dataclasses.dataclass
class StageTimes:
    ms: dict[str, float]  # median ms per stage over the timed rounds
    rounds: int  # rounds timed (warm-up excluded)
    state: SpecState  # the state after the last round (its `out` holds the tokens so far)
    # A hybrid target's verify ms by VERIFY_PARTS (they sum to ms["verify"]); empty for a dense target.
    verify_parts: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def round_ms(self) -> float:
        """The stages' sum: one round run stage by stage."""
        return sum(self.ms.values())

    def summary(self) -> str:
        """One line: the median ms of each stage, a hybrid's verify with its parts in brackets."""
        def stage(name: str, ms: float) -> str:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in self.verify_parts.items()) if name == "verify" else ""
            return f"{name} {ms:.2f}" + (f" ({parts})" if parts else "")
        split = ", ".join(stage(k, v) for k, v in self.ms.items())
        return (f"stages: median ms over {self.rounds} rounds, each stage its own program: {split} "
                f"(sum {self.round_ms:.2f}; the fused round pays no per-stage launch)")


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, (time.perf_counter() - t0) * 1e3


def profile_verify_parts(verify_ms: float, fn: Callable[[], Any], hlo_text: str) -> dict[str, float]:
    """`verify_ms` split by VERIFY_PARTS in proportion to the device time a profile of `fn()` (a
    hybrid verify's compiled program, whose HLO is `hlo_text`) spends under each mixer scope; the
    rest is all else. A profile that fails, or maps under half its time to HLO instructions, is
    an error rather than a split that would put the unmapped time in "rest"."""
    prof = profile_program(fn, hlo_text, calls=3, scopes=(ATTENTION_SCOPE, GDN_SCOPE))
    if "error" in prof or prof["unmapped_ms"] > 0.5 * prof["device_ms"]:
        raise RuntimeError(f"stage times: the hybrid verify's profile gives no split by layer kind: "
                           f"{prof.get('error') or prof.get('diagnostic')}")
    total = sum(prof["by_scope"].values())
    mixers = {k: prof["by_scope"].get(k, 0.0) for k in (ATTENTION_SCOPE, GDN_SCOPE)}
    shares = {**mixers, "rest": total - sum(mixers.values())}
    return {k: verify_ms * v / total for k, v in shares.items()}


def time_stages(target: ModelParams, cfg: ModelConfig, dparams: Any, dcfg: Any, prompts: jax.Array,
                prompt_lens: jax.Array, key: jax.Array, *, settings: SpecSettings, max_len: int,
                impl: Impl = Impl(), rounds: int = 8, warmup: int = 2) -> StageTimes:
    """Runs `warmup + rounds` real rounds stage by stage from right-padded prompts [batch, P].

    The first `warmup` rounds compile and are not timed. Rounds stop early once every sequence is
    done. The stages, and the PRNG keys they use, are those of `spec_round`, so the tokens equal
    the fused generation's. impl: as `generate_speculative` takes it (its `rounds_per_check`
    does not apply: every round is run and timed on its own). A hybrid target's verify is also
    split by kind of layer (`profile_verify_parts`; the module's docstring says how).
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds must be >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    s = settings
    if s.method == "mtp":
        raise ValueError("stage times split the DFlash drafter's pass from its tree; an MTP round is timed "
                         "whole (bench/spec_round.py --mtp-steps)")
    start = jax.jit(functools.partial(start_state, cfg=cfg, dcfg=dcfg, max_len=max_len, s=s, impl=impl))
    state = start(target, dparams=dparams, prompts=prompts, prompt_lens=prompt_lens, key=key)
    f_draft = jax.jit(lambda st, t, d: drafter_pass(st, t, d, dcfg, s))
    f_tree = jax.jit(lambda st, logits: propose(st, logits, s))

    def verify(st, draft, t):
        return verify_stage(st, draft, t, cfg, dcfg, impl)
    f_verify = jax.jit(verify)

    def accept(draft, logits, key):
        key, k_accept = jax.random.split(key)
        return accept_stage(k_accept, draft, logits, s), key
    f_accept = jax.jit(accept)
    f_commit = jax.jit(lambda st, draft, acc, taps, cache, d, key:
                       commit_stage(st, draft, *acc, taps, cache, cfg, d, dcfg, s, key, impl))
    samples: dict[str, list[float]] = {name: [] for name in STAGES}
    for i in range(warmup + rounds):
        if bool(jax.device_get(state.done).all()):
            break
        (logits, draft_cache), t_draft = _timed(f_draft, state, target, dparams)
        state = dataclasses.replace(state, draft_cache=draft_cache)  # as spec_round goes on with it
        (draft, key), t_tree = _timed(f_tree, state, logits)
        (vlogits, taps, cache), t_verify = _timed(f_verify, state, draft, target)
        verified_inputs = (state, draft, target)  # the stages are not donated: these stay valid
        (acc, key), t_accept = _timed(f_accept, draft, vlogits, key)
        state, t_commit = _timed(f_commit, state, draft, acc, taps, cache, dparams, key)
        if i >= warmup:
            for name, t in zip(STAGES, (t_draft, t_tree, t_verify, t_accept, t_commit)):
                samples[name].append(t)
    timed = len(samples["draft"])
    ms = {name: statistics.median(v) for name, v in samples.items()} if timed else {}
    parts: dict[str, float] = {}
    if timed and isinstance(cfg, Qwen35Config):
        traced = jax.jit(verify, compiler_options=COMMAND_BUFFERS_OFF).lower(*verified_inputs).compile()
        parts = profile_verify_parts(ms["verify"], lambda: traced(*verified_inputs), traced.as_text())
    return StageTimes(ms=ms, rounds=timed, state=state, verify_parts=parts)
