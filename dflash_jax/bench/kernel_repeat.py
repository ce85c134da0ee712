"""The Hopper tree-attention kernel run again and again on the same inputs: does it give the
same bits every time, and where does it differ from the float32 reference?

A kernel whose warpgroups hand shared memory to each other through barriers can race: then one
run in many goes wrong, and a parity test passes or fails by chance. This runs each case `--repeats`
times (each run a fresh launch of the same compiled program) and reports, per case: how many
distinct outputs came back, whether any was non-finite, and the largest relative error against
the reference over all rows, over the rows of the full blocks, and over the folded tail's rows
(per sequence), for the worst run.

    python -m dflash_jax.bench.kernel_repeat --repeats 20 --out repeat.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.bench.common import environment, log, write_json
from dflash_jax.bench.tree_attention_bench import random_tree_visibility
from pallas_kernels import tree_attention_hopper as hopper
from pallas_kernels.tree_attention import tree_attention_reference

# (batch, width, kv_heads, group, head_dim, max_len, lens, tails_last, fold)
CASES = {
    "w257-b2-headsmajor-fold": (2, 257, 8, 4, 128, 4400, [4096, 1001], False, True),
    "w257-b2-tailslast-fold": (2, 257, 8, 4, 128, 4400, [4096, 1001], True, True),
    "w257-b2-headsmajor-tails": (2, 257, 8, 4, 128, 4400, [4096, 1001], False, False),
    "w257-b1-default": (1, 257, 8, 4, 128, 5120, [4096], True, True),
    "w257-b1-headsmajor-fold": (1, 257, 8, 4, 128, 5120, [4096], False, True),
}


def make_inputs(seed: int, batch: int, width: int, kv_heads: int, group: int, head_dim: int, max_len: int,
                lens: list[int], dtype: Any = jnp.bfloat16, tree: bool = True) -> tuple[Any, ...]:
    """Random q/k/v, lens and visibility (None: causal), as the GPU parity tests make them. Slots
    past L+W hold large finite values: the kernel reads the rest of its last key block unmasked
    (its documented contract), and the bias must hide them."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, width, kv_heads * group, head_dim))
    k = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    v = rng.standard_normal((batch, max_len, kv_heads, head_dim))
    for b, length in enumerate(lens):
        k[b, length + width:] *= 50.0
        v[b, length + width:] *= 50.0
    visible = jnp.asarray(random_tree_visibility(rng, batch, width)) if tree else None
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lens, jnp.int32),
            visible)


def _rel(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30)) if out.size else 0.0


def run_case(name: str, spec: tuple, repeats: int, seed: int = 7) -> dict[str, Any]:
    batch, width, kv_heads, group, head_dim, max_len, lens, tails_last, fold = spec
    q, k, v, lens_a, visible = make_inputs(seed, batch, width, kv_heads, group, head_dim, max_len, lens)
    sched = dataclasses.replace(hopper.schedule(batch, kv_heads, width * group, max_len), tails_last=tails_last)
    if fold:
        sched = hopper.fold_tail(sched)
    fn = jax.jit(functools.partial(hopper.tree_attention_hopper, scale=head_dim ** -0.5, sched=sched))
    ref = np.asarray(tree_attention_reference(q, k, v, lens_a, visible), np.float64)
    tail0 = sched.full_blocks * hopper.ROWS_PER_BLOCK // group
    outs = [np.asarray(jax.block_until_ready(fn(q, k, v, lens_a, visible)), np.float64) for _ in range(repeats)]
    distinct = len({o.tobytes() for o in outs})
    worst = {"all": 0.0, "main": 0.0, "tail": 0.0}
    per_seq = [{"main": 0.0, "tail": 0.0} for _ in range(batch)]
    nonfinite = 0
    for o in outs:
        if not np.all(np.isfinite(o)):
            nonfinite += 1
            continue
        worst["all"] = max(worst["all"], _rel(o, ref))
        worst["main"] = max(worst["main"], _rel(o[:, :tail0], ref[:, :tail0]))
        worst["tail"] = max(worst["tail"], _rel(o[:, tail0:], ref[:, tail0:]))
        for b in range(batch):
            per_seq[b]["main"] = max(per_seq[b]["main"], _rel(o[b, :tail0], ref[b, :tail0]))
            per_seq[b]["tail"] = max(per_seq[b]["tail"], _rel(o[b, tail0:], ref[b, tail0:]))
    return {"case": name, "sched": {"full_blocks": sched.full_blocks, "main_split": sched.main_split,
                                    "tail_split": sched.tail_split, "fold_tail": sched.fold_tail,
                                    "tails_last": sched.tails_last, "stages": sched.stages},
            "repeats": repeats, "distinct_outputs": distinct, "nonfinite_runs": nonfinite,
            "worst_rel_err": {k2: round(v2, 5) for k2, v2 in worst.items()},
            "per_sequence": [{k2: round(v2, 5) for k2, v2 in s.items()} for s in per_seq]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    env = environment()
    print(env, flush=True)
    rows = []
    for name in args.cases:
        try:
            rows.append(run_case(name, CASES[name], args.repeats))
        except Exception as err:  # noqa: BLE001 - report and go on to the next case
            rows.append({"case": name, "error": f"{type(err).__name__}: {err}"[:500]})
        log(rows[-1])
    print("| case | distinct outputs | non-finite runs | worst rel. err: all / main / tail | per sequence (main / tail) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | error: {r['error'][:120]} | | | |")
            continue
        w = r["worst_rel_err"]
        seqs = "; ".join(f"{s['main']} / {s['tail']}" for s in r["per_sequence"])
        print(f"| {r['case']} | {r['distinct_outputs']} of {r['repeats']} | {r['nonfinite_runs']} | "
              f"{w['all']} / {w['main']} / {w['tail']} | {seqs} |")
    if args.out:
        write_json(args.out, {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
