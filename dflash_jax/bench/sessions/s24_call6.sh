#!/bin/bash
# Twenty-fourth session, call 6: is the kernel path's loss in turns a cost per call (amortised
# over the rounds of one while loop) or per round? DDTree(256) with XLA's MLP and with the
# 6-stage pingpong kernel, 32 rounds a call, first timings then in turns (no profile).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --mlp xla kernel --no-profile \
  --rounds-per-call 32 --interleave 5 --out $OUT/rounds_pingpong_r32.json > $OUT/rounds_pingpong_r32.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_pingpong_r32.raw
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
