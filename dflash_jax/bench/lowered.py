"""Decoding's GPU programs, lowered for cuda on any machine: what a refactor changed in them.

A CPU machine can lower a jitted program for the `cuda` platform, Pallas kernels included (their
Triton IR and Mosaic GPU binaries are built at lowering time). This tool lowers the three
generations decoding compiles (AR, DFlash and DDTree) at a model shape as a GPU would take them:
the backend is reported as "gpu", so every kernel is chosen where it applies, and the Hopper
kernel is taken or not by `--gpu`. Source locations are left out, so two checkouts of the same
program give the same text. Run it in two checkouts and compare the printed digests (or `diff`
the written files): an identical program runs at the same speed, so a change that leaves them
identical needs no GPU run to show that nothing got slower.

    python -m dflash_jax.bench.lowered --model qwen3-8b --out /tmp/lowered
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
from typing import Any

import jax
import jax.numpy as jnp

PROGRAMS = ("ar", "dflash", "ddtree")


def pretend_gpu(hopper: bool) -> None:
    """Makes the process choose kernels as on a GPU (Hopper's or another) while it lowers for
    cuda on whatever backend it has. Only for lowering: nothing can run after this."""
    from jax._src import source_info_util

    from pallas_kernels import tree_attention_hopper

    jax.config.update("jax_traceback_in_locations_limit", 0)
    # Source lines end up inside the kernels' IR; without them the text depends on the program only.
    source_info_util.current = lambda: source_info_util.SourceInfo(None, source_info_util.current_name_stack())
    jax.default_backend = lambda: "gpu"
    tree_attention_hopper.available = lambda: hopper


def lower_programs(model: str, ctx: int, new: int, budget: int, dtype: Any = jnp.bfloat16) -> dict[str, str]:
    """{program: StableHLO text} of decoding's AR, DFlash (block 16) and DDTree(`budget`)
    generations for one prompt of `ctx` tokens and `new` new tokens, with abstract weights of
    the `model` shape (`bench.common.SHAPES`) and a 5-layer drafter (`spec_round.drafter_config`)."""
    from dflash_jax import drafter as dr
    from dflash_jax.bench.common import dense_shape
    from dflash_jax.bench.spec_round import drafter_config
    from dflash_jax.generate import generate_ar
    from dflash_jax.model import init_params
    from dflash_jax.speculative import SpecSettings, speculative_program

    cfg = dense_shape(model, "lowered")
    dcfg = drafter_config(cfg)
    target = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype))
    dparams = jax.eval_shape(lambda: dr.init_draft_params(dcfg, jax.random.key(1), dtype))
    prompts = jax.ShapeDtypeStruct((1, ctx), jnp.int32)
    lens = jax.ShapeDtypeStruct((1,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))

    def slots(slack: int) -> int:  # the cache as pipeline.default_max_len sizes it: whole 64s
        return -(-(ctx + new + slack) // 64) * 64

    texts = {"ar": generate_ar.trace(target, cfg, prompts, lens, key, max_new_tokens=new, max_len=slots(1))}
    for method, b in (("dflash", 0), ("ddtree", budget)):
        s = SpecSettings(method=method, block_size=dcfg.block_size, budget=b, max_new_tokens=new)
        texts[method] = speculative_program(s).trace(target, cfg, dparams, dcfg, prompts, lens, key, settings=s,
                                                     max_len=slots(s.cache_slack()))
    return {name: traced.lower(lowering_platforms=("cuda",)).as_text() for name, traced in texts.items()}


def kernels_of(text: str) -> dict[str, int]:
    """Pallas kernels named in a lowered program, by name (Triton calls) and Mosaic GPU calls."""
    counts: dict[str, int] = {}
    for name in re.findall(r'ir = "(?:[^"\\]|\\.)*", name = "([A-Za-z0-9_]+)"', text):
        counts[name] = counts.get(name, 0) + 1
    mosaic = len(re.findall(r"custom_call @mosaic_gpu", text))
    if mosaic:
        counts["mosaic_gpu"] = mosaic
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b", help="a bench.common.SHAPES name")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--budget", type=int, default=256, help="DDTree's node budget")
    ap.add_argument("--gpu", choices=("hopper", "other"), default="hopper",
                    help="lower as on a Hopper GPU (the Mosaic kernel where it applies) or another (Triton)")
    ap.add_argument("--out", help="write each program's text to OUT/PROGRAM.mlir")
    args = ap.parse_args()
    pretend_gpu(args.gpu == "hopper")
    texts = lower_programs(args.model, args.ctx, args.new, args.budget)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    for name in PROGRAMS:
        text = texts[name]
        if args.out:
            with open(os.path.join(args.out, f"{name}.mlir"), "w") as f:
                f.write(text)
        kernels = ", ".join(f"{k} x{n}" for k, n in sorted(kernels_of(text).items()))
        print(f"{name}: sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}, {len(text)} chars; {kernels}")


if __name__ == "__main__":
    main()
