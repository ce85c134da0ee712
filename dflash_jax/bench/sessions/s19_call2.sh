#!/bin/bash
# Nineteenth session, call 2: DDTree's row block 16 / 8 / 1 (W 272 / 264 / 257 at budget 256).
# 1. GPU parity at W 264 and 257: the Hopper kernel, and the fused verify path (epilogue + kernel).
# 2. DDTree(256) at row blocks 16, 8 and 1, side by side in one process, with the kernel table.
# 3. Budgets 16 / 64 / 512 at row blocks 16 and 8, side by side.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout 120 python -m pytest -q -p no:warnings tests/test_tree_attention.py tests/test_qkv_epilogue.py -k "gpu and (264 or 257)" 2>&1 | tail -3 | tee $OUT/gpu_tests.log
echo "=== rounds 256"
timeout 220 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --row-block 16 8 1 --kernel-table 60 --out $OUT/rounds_row_block.json > $OUT/rounds_row_block.raw 2>&1; grep -E "^\||rror" $OUT/rounds_row_block.raw
echo "=== budgets"
timeout 230 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --row-block 16 8 --no-profile --out $OUT/rounds_budgets.json > $OUT/rounds_budgets.raw 2>&1; grep -E "^\||rror" $OUT/rounds_budgets.raw
