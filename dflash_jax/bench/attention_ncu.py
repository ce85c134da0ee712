"""The verify's tree attention as the round runs it, for Nsight Compute (`ncu`).

Runs `tree_attention_rows` (the Hopper kernel with the model's schedule, then `split_merge`)
at the Qwen3-8B heads (32 q / 8 kv x 128), bf16, batch 1, a `--ctx` prefix and W `--width`
tree tokens (causal: the mask only touches the last key blocks), `--calls` times, so that a
profiler can pick one launch after warm-up:

    ncu --kernel-name regex:mosaic --launch-skip 3 --launch-count 1 --set full \\
        python -m dflash_jax.bench.attention_ncu --ctx 4096 --width 257
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention import rows_schedule, tree_attention_rows

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--width", type=int, default=257)
    ap.add_argument("--calls", type=int, default=8)
    args = ap.parse_args()
    max_len = -(-(args.ctx + args.width) // 8) * 8
    sched = rows_schedule(1, args.width, Q_HEADS, KV_HEADS, HEAD_DIM, max_len, jnp.bfloat16)
    if sched is None:
        raise SystemExit("attention_ncu: the Hopper kernel does not take this shape on this backend")
    print(sched, flush=True)
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q_rows = jax.random.normal(kq, (1, KV_HEADS, sched.padded_rows, HEAD_DIM), jnp.bfloat16)
    k = jax.random.normal(kk, (1, max_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    v = jax.random.normal(kv, (1, max_len, KV_HEADS, HEAD_DIM), jnp.bfloat16)
    lens = jnp.array([args.ctx], jnp.int32)
    group = Q_HEADS // KV_HEADS
    fn = jax.jit(lambda q: tree_attention_rows(q, k, v, lens, None, width=args.width, group=group, sched=sched))
    for _ in range(args.calls):
        out = fn(q_rows)
    print("done", out.shape, float(jnp.abs(out.astype(jnp.float32)).mean()), flush=True)


if __name__ == "__main__":
    main()
