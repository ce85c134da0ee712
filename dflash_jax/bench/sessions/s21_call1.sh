#!/bin/bash
# Twenty-first session, call 1: today's default DDTree(256) round with its 150 costliest kernels
# (launches, stage, op), and the round at 8 against 32 rounds per call, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout 280 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 256 --kernel-table 150 \
  --rounds-per-call 8 32 --interleave 5 --out $OUT/rounds_table.json > $OUT/rounds_table.raw 2>&1
grep -E "^\||^interleaved|^gaps|rror|fail" $OUT/rounds_table.raw
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
