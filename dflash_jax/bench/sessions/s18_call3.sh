#!/bin/bash
# Eighteenth session, call 3 (commit after the per-depth kernel's removal): today's default tree.
# 1. GPU parity: preselected_top_k against lax.top_k, and the tree with it against the paper's heap,
#    run on the GPU.
# 2. The top-k alone and whole trees at [15, 151936], budgets 512 and 64 (not timed in call 2).
# 3. DDTree(256) rounds, the seventeenth session's tree (preselect 0) against today's default,
#    side by side in one process, with the kernel table; then budgets 16 / 64 / 512 the same way.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout 100 python -m pytest -q -p no:warnings tests/test_tree.py -k "preselect or heap or chunked or ranked" 2>&1 | tail -3 | tee $OUT/gpu_tests.log
echo "=== top-k"
timeout 100 python -m dflash_jax.bench.top_k_bench --budgets 512 64 --fanouts 2 4 8 --calls 4 --out $OUT/top_k.json > $OUT/top_k.raw 2>&1; grep -E "^\||rror" $OUT/top_k.raw
echo "=== rounds 256"
timeout 130 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --preselect 0 auto --kernel-table 80 --out $OUT/rounds_preselect.json > $OUT/rounds_preselect.raw 2>&1; grep -E "^\||rror" $OUT/rounds_preselect.raw
echo "=== budgets"
timeout 190 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --preselect 0 auto --no-profile --out $OUT/rounds_budgets.json > $OUT/rounds_budgets.raw 2>&1; grep -E "^\||rror" $OUT/rounds_budgets.raw
