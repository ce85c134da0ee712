"""Drafter training-step throughput: the target's taps computed in the step against taps read from disk.

    python -m dflash_jax.bench.train_step --model qwen3.6-27b --layers 5 --batch 4 --seq-len 2048 --out R.json

Random bf16 weights of a named target shape (dense or hybrid) on one device (`--tp T`: split over
T devices, as `train --tp T` places them; the drafter replicated, the batch whole), a drafter of
`--layers` layers shaped for it, random token rows. Two ways to feed the taps to `train_step`:
  in-step  the target runs its forward over each batch inside the step (`train.target_taps`);
  disk     the taps were written once (`train_data.TapStore`); each step reads its rows back
           from the file, copies them to the device and skips the target's forward.
Per way: median step time, tokens/s (batch x seq_len / step), and what the choice trades: the
target's forward FLOPs per step against the bytes per token on disk and the time to read them.
The disk figure reads from the page cache when the file fits in host memory; `read_ms` times the
host read alone, so a slower disk can be judged by its bandwidth.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax import drafter as dr
from dflash_jax import sharding as sh
from dflash_jax import train as tr
from dflash_jax.bench.common import SHAPES, environment, log, time_fn, write_json
from dflash_jax.qwen3_5 import Qwen35Config
from dflash_jax.train_data import TapStore

MODES = ("in-step", "disk")


def target_flops(params: Any, tokens: int) -> float:
    """2 x weights touched per token x tokens: the target's matmuls for the taps (embedding lookup
    and LM head excluded: the taps need neither). Attention scores are left out (a few % at 2K)."""
    total = sum(x.size for x in jax.tree.leaves(params))
    skipped = params.embed.size + (params.lm_head.size if getattr(params, "lm_head", None) is not None else 0)
    return 2.0 * (total - skipped) * tokens


def init_target(cfg: Any, dtype: Any, mesh: Any = None) -> Any:
    """Random weights drawn straight into their tp shards under `mesh` (a 27B target fits no one GPU of 48 GB)."""
    if isinstance(cfg, Qwen35Config):
        from dflash_jax.qwen3_5 import init_params
    else:
        from dflash_jax.model import init_params
    return init_params(cfg, jax.random.key(0), dtype, mesh=mesh)


def run(model: str, layers: int, batch: int, seq_len: int, blocks: int, block_size: int, batches: int,
        iters: int, taps_dir: str | None, modes: tuple[str, ...], tp: int = 1) -> dict[str, Any]:
    cfg = SHAPES[model]
    dtype = jnp.bfloat16
    tc = tr.TrainConfig(steps=1000, batch_size=batch, seq_len=seq_len, num_blocks=blocks, compute_dtype="bfloat16")
    dcfg = tr.drafter_config_for(cfg, num_layers=layers, block_size=block_size, mask_token_id=cfg.vocab_size - 1)
    log(f"target {model} at tp {tp}, drafter {layers} layers (taps {list(dcfg.target_layer_ids)}), "
        f"batch {batch} x {seq_len}")
    mesh = tr.data_parallel_mesh(1, batch, tp)  # None at tp = 1: one device, as before
    tr.check_target_tp(cfg, tp)
    target = init_target(cfg, dtype, mesh)
    state = tr.place_replicated(tr.init_state(dr.init_draft_params(dcfg, jax.random.key(1), training=True), tc),
                                mesh)
    rng = np.random.default_rng(0)
    rows = batch * batches
    tokens = rng.integers(0, cfg.vocab_size - 1, (rows, seq_len), dtype=np.int32)
    prompt_lens = np.full(rows, seq_len // 8, np.int32)
    total_lens = np.full(rows, seq_len, np.int32)

    def host_batch(i: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
        idx = np.arange(i % batches * batch, i % batches * batch + batch)
        return {"tokens": tokens[idx], "prompt_lens": prompt_lens[idx], "total_lens": total_lens[idx]}, idx

    features = len(dcfg.target_layer_ids) * cfg.hidden_size
    record: dict[str, Any] = {
        "model": model, "tp": tp, "layers": layers, "taps": list(dcfg.target_layer_ids), "batch": batch,
        "seq_len": seq_len,
        "blocks": blocks, "block_size": block_size, "tokens_per_step": batch * seq_len,
        "target_gflop_per_step": target_flops(target, batch * seq_len) / 1e9,
        "disk_bytes_per_token": features * jnp.dtype(dtype).itemsize, "modes": {}}
    step = tr.train_step
    counter = {"i": 0}

    def in_step() -> Any:
        b, _ = host_batch(counter["i"])
        counter["i"] += 1
        return step(state, target, tr.place_batch(b, mesh), cfg=cfg, dcfg=dcfg, tc=tc)

    # A taps file of the default temporary directory is removed when the run ends (it holds
    # batches x batch x seq_len x features bytes: 1.7 GB at the defaults).
    with contextlib.ExitStack() as cleanup:
        store = None
        if "disk" in modes:
            directory = taps_dir or cleanup.enter_context(tempfile.TemporaryDirectory(prefix="taps-"))
            store = TapStore.create(directory, rows, seq_len, features, "bfloat16", dcfg.target_layer_ids)
            taps_fn = jax.jit(tr.target_taps, static_argnums=(1, 3))
            t0 = time.perf_counter()
            for i in range(batches):
                b, idx = host_batch(i)
                with sh.use_mesh(mesh):
                    taps, _ = taps_fn(target, cfg, tr.place_batch(b, mesh)["tokens"], dcfg.target_layer_ids)
                store.write(int(idx[0]), np.asarray(taps))
            record["write_seconds"] = time.perf_counter() - t0
            record["taps_file_gb"] = rows * seq_len * record["disk_bytes_per_token"] / 1e9
            log(f"wrote {record['taps_file_gb']:.2f} GB of taps in {record['write_seconds']:.1f} s to {directory}")
        reads: list[float] = []

        def from_disk() -> Any:
            b, idx = host_batch(counter["i"])
            counter["i"] += 1
            t0 = time.perf_counter()
            taps = store.read(idx)
            reads.append((time.perf_counter() - t0) * 1e3)
            return step(state, target, tr.place_batch({**b, "taps": taps}, mesh), cfg=cfg, dcfg=dcfg, tc=tc)

        for mode in modes:
            reads.clear()
            with sh.use_mesh(mesh):  # the step compiles for the mesh it is traced under
                t = time_fn(in_step if mode == "in-step" else from_disk, warmup=2, iters=iters)
            out = {**t, "tokens_per_s": batch * seq_len / (t["median_ms"] * 1e-3)}
            if mode == "disk":
                out["read_ms"] = float(np.median(reads[2:] or reads))
                out["read_gb_per_s"] = batch * seq_len * record["disk_bytes_per_token"] / (out["read_ms"] * 1e-3) / 1e9
            record["modes"][mode] = out
            log(mode, f"{out['median_ms']:.1f} ms a step, {out['tokens_per_s']:.0f} tokens/s")
        return record


def table(record: dict[str, Any]) -> str:
    lines = [f"{record['model']} at tp {record['tp']}, {record['layers']}-layer drafter, "
             f"batch {record['batch']} x {record['seq_len']}: "
             f"target {record['target_gflop_per_step']:.4g} GFLOP/step in the step, or "
             f"{record['disk_bytes_per_token'] / 1e3:.1f} KB/token on disk",
             "", "| taps | step ms (median) | tokens/s | host read ms |", "|---|---|---|---|"]
    for mode, r in record["modes"].items():
        read = f"{r['read_ms']:.1f} ({r['read_gb_per_s']:.1f} GB/s)" if "read_ms" in r else "-"
        lines.append(f"| {mode} | {r['median_ms']:.1f} | {r['tokens_per_s']:.0f} | {read} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen3.6-27b")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--blocks", type=int, default=32, help="anchors (blocks) per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=int, default=4, help="distinct batches of rows (and of taps on disk)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--taps-dir", default=None, help="where the taps file goes (default: a temporary directory)")
    p.add_argument("--tp", type=int, default=1, help="devices the target is split over (tensor parallel)")
    p.add_argument("--out", default=None, help="JSON results")
    a = p.parse_args(argv)
    for flag in ("layers", "batch", "seq_len", "blocks", "batches", "iters", "tp"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1")
    record = run(a.model, a.layers, a.batch, a.seq_len, a.blocks, a.block_size, a.batches, a.iters, a.taps_dir,
                 tuple(a.modes), a.tp)
    record["environment"] = environment()
    write_json(a.out, record)
    print(table(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
