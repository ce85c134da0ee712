#!/bin/bash
# Eighteenth session, call 1: DDTree's vocabulary top-k without sorts (tree.preselected_top_k).
# 1. The top-k alone and the whole tree, lax.top_k / chunked / preselection at fan-outs 4, 8, 16,
#    at [15, 151936] and budgets 256, 16, 64, 512 (each checked against lax.top_k first).
# 2. DDTree(256) rounds with the preselection off (the seventeenth session's tree) and at the
#    default, side by side in one process, with the kernel table.
# 3. Budgets 16 / 64 / 512, both ways.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout 200 python -m dflash_jax.bench.top_k_bench --budgets 256 16 64 512 --fanouts 4 8 16 --calls 4 --out $OUT/top_k.json 2>&1 | grep -E "^\||rror" | tee $OUT/top_k.log
echo "=== rounds 256"
timeout 170 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --preselect 0 auto --kernel-table 60 --out $OUT/rounds_preselect.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_preselect.log
echo "=== budgets"
timeout 180 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --preselect 0 auto --no-profile --out $OUT/rounds_budgets.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_budgets.log
