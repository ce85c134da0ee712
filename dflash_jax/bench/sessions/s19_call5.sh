#!/bin/bash
# Nineteenth session, call 5: why DDTree(16) at W 17 took 8.99 ms against 6.88 at W 32 (call 4):
# the kernel tables of W 24 and W 17, side by side in one process.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 170 python -m dflash_jax.bench.spec_round --ctx --budgets 16 --row-block 8 1 --kernel-table 40 --out $OUT/rounds_w17.json > $OUT/rounds_w17.raw 2>&1; grep -E "^\||^gaps|rror" $OUT/rounds_w17.raw
