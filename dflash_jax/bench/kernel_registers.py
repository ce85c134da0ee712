"""Registers and spills of the tree-GDN Triton kernels for a GPU arch, on any machine.

Register spills (values a thread stores to local memory and loads back) made these kernels 5-20x
slower than XLA on an H100 (BENCHMARKS.md, "The tree-GDN verify"), and a profile shows only the
time, not the cause. A CPU machine can lower the kernels for cuda (Pallas builds their Triton IR
at lowering time); Triton's compiler turns that IR into PTX for an arch, and ptxas, which ships
with it, reports each kernel's registers and spills. So a change of tiling or structure can be
checked for spills on Hopper (sm_90a) and on Ampere (sm_86, the RTX A6000) before any GPU run.
Each row also has the seconds Triton and ptxas took (`compile_s`, on this machine's CPU): an
unrolled kernel whose compile grows with W shows there too.

    pip install triton    # the compiler and its ptxas; not a dependency of dflash-jax
    python -m dflash_jax.bench.kernel_registers --widths 16 65 257 --arch 90 86

The Triton here may be newer than the one jaxlib compiles with on a GPU: the counts are a
guide for comparing variants, and the timings of `gdn_verify_bench` are the judge.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import subprocess
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflash_jax.bench.common import SHAPES
from dflash_jax.qwen3_5 import Qwen35Config
from pallas_kernels.tree_gdn import BlockSizes, default_block_sizes, tree_gdn_pallas

_PTXAS = {"registers": r"Used (\d+) registers", "stack_bytes": r"(\d+) bytes stack frame",
          "spill_store_bytes": r"(\d+) bytes spill stores", "spill_load_bytes": r"(\d+) bytes spill loads"}


def parse_ptxas(report: str) -> dict[str, int]:
    """ptxas -v's report of one kernel -> {registers, stack_bytes, spill_store_bytes,
    spill_load_bytes} (0 where ptxas prints no such line)."""
    if not re.search(_PTXAS["registers"], report):
        raise ValueError(f"no register count in the ptxas report: {report[:200]!r}")
    return {key: int(m.group(1)) if (m := re.search(pattern, report)) else 0 for key, pattern in _PTXAS.items()}


def triton_ir(fn: Any, *args: jax.ShapeDtypeStruct) -> list[tuple[str, str]]:
    """(kernel name, Triton IR text) of every Pallas Triton kernel in `fn(*args)` lowered for cuda,
    in lowering order. Reads the IR where Pallas builds it (`lower_jaxpr_to_triton_module`)."""
    from jax._src.pallas.triton import lowering

    found: list[tuple[str, str]] = []
    build = lowering.lower_jaxpr_to_triton_module

    def capture(*a: Any, **kw: Any) -> Any:
        result = build(*a, **kw)
        text = result.module.operation.get_asm(enable_debug_info=False)
        found.append((re.search(r"tt\.func public @(\w+)", text).group(1), text))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        lowering.lower_jaxpr_to_triton_module = build
    if not found:
        raise ValueError("no Pallas Triton kernel was lowered for cuda in this program")
    return found


def ptxas_report(ir: str, arch: int, num_warps: int, num_stages: int) -> dict[str, int]:
    """Compiles Triton IR for sm_<arch> (90 means sm_90a) with Triton's compiler and returns ptxas'
    counts (`parse_ptxas`). Needs the `triton` package."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path  # the ptxas whose PTX version Triton wrote for
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ttir")
        with open(source, "w") as f:
            f.write(ir)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        sm = "sm_90a" if arch == 90 else f"sm_{arch}"
        done = subprocess.run([ptxas, f"-arch={sm}", "-v", ptx, "-o", os.path.join(tmp, "kernel.cubin")],
                              capture_output=True, text=True, check=True)
    return parse_ptxas(done.stdout + done.stderr)


def tree_gdn_kernels(cfg: Qwen35Config, width: int, tiling: BlockSizes) -> list[tuple[str, str]]:
    """The tree-GDN kernels' Triton IR at cfg's GDN shape, batch 1, W nodes, at `tiling`."""
    f32 = jnp.float32
    keys = jax.ShapeDtypeStruct((1, cfg.gdn_key_heads, width, cfg.gdn_key_dim), f32)
    values = jax.ShapeDtypeStruct((1, cfg.gdn_value_heads, width, cfg.gdn_value_dim), f32)
    gates = jax.ShapeDtypeStruct((1, cfg.gdn_value_heads, width), f32)
    visible = jax.ShapeDtypeStruct((1, width, width), jnp.bool_)
    state = jax.ShapeDtypeStruct((1, cfg.gdn_value_heads, cfg.gdn_key_dim, cfg.gdn_value_dim), f32)
    fn = functools.partial(tree_gdn_pallas, **dataclasses.asdict(tiling))
    return triton_ir(fn, keys, keys, values, gates, gates, visible, state)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3.6-27b", help="a hybrid shape of bench.common.SHAPES")
    p.add_argument("--widths", type=int, nargs="+", default=[16, 65, 257], help="tree nodes W (budget + 1)")
    p.add_argument("--arch", type=int, nargs="+", default=[90, 86], help="compute capabilities (90: sm_90a)")
    p.add_argument("--out", help="JSON file for the rows")
    a = p.parse_args(argv)
    cfg = SHAPES.get(a.model)
    if not isinstance(cfg, Qwen35Config):
        p.error(f"--model {a.model!r} is not a hybrid shape")
    if min(a.widths) < 1:
        p.error(f"--widths must be >= 1, got {a.widths}")
    if importlib.util.find_spec("triton") is None:
        p.error("needs Triton's compiler and ptxas: pip install triton (not a dependency of dflash-jax)")
    rows = []
    for width in a.widths:
        tiling = default_block_sizes(1, cfg.gdn_value_heads, width, cfg.gdn_key_dim, cfg.gdn_value_dim)
        for name, ir in tree_gdn_kernels(cfg, width, tiling):
            for arch in a.arch:
                start = time.perf_counter()
                report = ptxas_report(ir, arch, tiling.num_warps, tiling.num_stages)
                row = {"width": width, "kernel": name, "arch": arch, "block": tiling.block,
                       "block_v": tiling.block_v, "num_warps": tiling.num_warps, **report,
                       "compile_s": round(time.perf_counter() - start, 2)}
                rows.append(row)
                print(f"W {width:4d} {name:24s} sm_{arch}: {row['registers']} registers, "
                      f"{row['spill_store_bytes']} / {row['spill_load_bytes']} bytes spill stores / loads, "
                      f"compiled in {row['compile_s']:.1f} s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
