#!/bin/bash
# Nineteenth session, call 3: where a DDTree(256) round's idle GPU time comes from
# (bench.profile.gap_sizes: gaps by length, the longest named), at W 272 and 257, with XLA's
# command buffers off (as decoding compiles DDTree) and on for every command type, side by
# side in one process.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout 480 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --row-block 16 1 --command-buffers off all --kernel-table 60 --out $OUT/rounds_gaps.json > $OUT/rounds_gaps.raw 2>&1; grep -E "^\||^gaps|rror" $OUT/rounds_gaps.raw
