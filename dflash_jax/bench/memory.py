"""Per-GPU memory of a hybrid target + DFlash drafter at tensor parallelism tp, computed (not measured).

Every buffer's per-device bytes come from its declared shape (`jax.eval_shape`, no allocation)
and the shard shape of the NamedSharding the model would place it with (`qwen3_5.model_specs`,
`qwen3_5.cache_shardings`, `drafter.draft_specs` under the same rules as the loaders) on an
abstract ("dp", "tp") mesh, so no device is needed. Rows: target weights, the attention layers'
K/V cache, GDN states (conv state + float32 recurrent state), drafter weights, the drafter's
context K/V cache. Left out: activations and compiler temporaries of the decoding programs
(the measured 32B table in BENCHMARKS.md has them).

    python -m dflash_jax.bench.memory --model qwen3.6-27b --tp 1 2 --ctx 32768
"""
from __future__ import annotations

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from dflash_jax import drafter as dr
from dflash_jax import qwen3_5 as q35
from dflash_jax import sharding as sh
from dflash_jax.config import default_tap_layers
from dflash_jax.params import is_spec

MODELS: dict[str, q35.Qwen35Config] = {"qwen3.6-27b": q35.QWEN36_27B}
ROWS = ("target weights", "KV cache", "GDN states", "drafter weights", "drafter cache")


def drafter_config(cfg: q35.Qwen35Config, layers: int = 5, block_size: int = 16) -> dr.DraftConfig:
    """A drafter of the target's width and attention shape, tapping `layers` target layers (as the
    dense benchmarks' `bench.spec_round.drafter_config`)."""
    return dr.DraftConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_layers=layers,
                          num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                          vocab_size=cfg.vocab_size, mask_token_id=cfg.vocab_size - 1,
                          target_layer_ids=default_tap_layers(cfg.num_layers, layers),
                          num_target_layers=cfg.num_layers, block_size=block_size, rms_norm_eps=cfg.rms_norm_eps,
                          rope=cfg.rope)


def abstract_mesh(dp: int, tp: int) -> AbstractMesh:
    return AbstractMesh((dp, tp), (sh.DP, sh.TP), axis_types=(AxisType.Auto, AxisType.Auto))


def _bytes(shapes: Any, shardings: Any) -> int:
    """Per-device bytes of a tree of ShapeDtypeStructs laid out by a matching tree of NamedShardings."""
    pairs = zip(jax.tree.leaves(shapes), jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)))
    return sum(int(np.prod(s.shard_shape(x.shape))) * jnp.dtype(x.dtype).itemsize for x, s in pairs)


def _spec_bytes(specs: Any, mesh: AbstractMesh, dtype: Any) -> int:
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)
    return _bytes(shapes, sh.specs_shardings(specs, mesh))


def memory_table(cfg: q35.Qwen35Config, dcfg: dr.DraftConfig, ctx: int, tp: int, batch: int = 1,
                 dtype: Any = jnp.bfloat16) -> dict[str, int]:
    """{row: bytes per GPU} (`ROWS`) for weights in `dtype` and caches of `ctx` tokens at (dp 1, tp).

    Raises sharding.ShardingError naming the numbers when a head count does not fit tp.
    """
    mesh = abstract_mesh(1, tp)
    q35.check_tp(cfg, tp)
    sh.check_model(dcfg, tp)
    cache = jax.eval_shape(lambda: q35.HybridCache.create(cfg, batch, ctx, dtype))
    cache_sh = q35.cache_shardings(cfg, batch, ctx, mesh)
    dcache = jax.eval_shape(lambda: dr.DraftCache.create(dcfg, batch, ctx, dtype))
    dcache_sh = sh.cache_sharding(mesh, batch, dcfg.num_kv_heads)
    return {
        "target weights": _spec_bytes(q35.model_specs(cfg), mesh, dtype),
        "KV cache": _bytes((cache.k, cache.v), (cache_sh.k, cache_sh.v)),
        "GDN states": _bytes((cache.conv, cache.state), (cache_sh.conv, cache_sh.state)),
        "drafter weights": _spec_bytes(dr.draft_specs(dcfg, tp), mesh, dtype),
        "drafter cache": _bytes(dcache.k + dcache.v, [dcache_sh] * (2 * dcfg.num_layers)),
    }


def format_table(tables: dict[int, dict[str, int]]) -> str:
    """A markdown table, one column per tp, GB (1e9 bytes) per GPU."""
    tps = list(tables)
    lines = ["| per GPU, GB | " + " | ".join(f"tp = {t}" for t in tps) + " |",
             "|---|" + "---:|" * len(tps)]
    for row in ROWS + ("total",):
        vals = [sum(tables[t].values()) if row == "total" else tables[t][row] for t in tps]
        name = f"**{row}**" if row == "total" else row
        lines.append(f"| {name} | " + " | ".join(f"{v / 1e9:.2f}" for v in vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="qwen3.6-27b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--ctx", type=int, default=32768, help="cache length (tokens) of the target and the drafter")
    p.add_argument("--draft-layers", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print {tp: {row: bytes}} instead of the table")
    args = p.parse_args(argv)
    cfg = MODELS[args.model]
    dcfg = drafter_config(cfg, args.draft_layers)
    tables = {t: memory_table(cfg, dcfg, args.ctx, t, args.batch) for t in args.tp}
    print(json.dumps(tables) if args.json else format_table(tables))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
