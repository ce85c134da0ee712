#!/bin/bash
# Twenty-second session, call 2: today's defaults, the round table again on this machine:
# AR and DFlash at ctx 4K, DDTree at budgets 16 / 64 / 256 / 512 (ctx 4K) with the per-stage
# profile, then all of them again in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout 560 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 256 16 64 512 \
  --interleave 4 --out $OUT/rounds_table.json > $OUT/rounds_table.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_table.raw
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
