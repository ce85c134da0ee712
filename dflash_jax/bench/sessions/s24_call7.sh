#!/bin/bash
# Twenty-fourth session, call 7: 8 against 32 rounds a call in one process (call 6 ran 32 on
# another machine than calls 1-4 ran 8), XLA's MLP and the 6-stage pingpong kernel, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 400 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --mlp xla kernel --no-profile \
  --rounds-per-call 8 32 --interleave 4 --out $OUT/rounds_r8_r32.json > $OUT/rounds_r8_r32.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_r8_r32.raw
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
