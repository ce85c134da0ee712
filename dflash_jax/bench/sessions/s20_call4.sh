#!/bin/bash
# Twentieth session, call 4: the new default width (W = 1 + budget, tree.ROW_BLOCK 1) against the
# old one (row block 16), timed in turns (spec_round --interleave), and the per-stage breakdown at
# budgets 16 / 64 / 256 / 512 with today's defaults (BENCHMARKS.md (b), (c)).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== row block 1 against 16, in turns"
timeout 250 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 256 512 --row-block 1 16 --no-profile \
  --interleave 4 --out $OUT/rounds_row_block.json > $OUT/rounds_row_block.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_row_block.raw
echo "=== breakdown"
timeout 200 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 256 512 \
  --out $OUT/rounds_breakdown.json > $OUT/rounds_breakdown.raw 2>&1; grep -E "^\||rror|fail" $OUT/rounds_breakdown.raw
python -m dflash_jax.bench.plot_budget $OUT/rounds_breakdown.json $OUT/ddtree_latency_vs_budget_h200_s20.png
