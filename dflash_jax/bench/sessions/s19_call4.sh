#!/bin/bash
# Nineteenth session, call 4: W = 1 + budget (row block 1) against the multiple of 16, every budget.
# 1. GPU parity at the new widths: the Hopper kernel at W 257 / 264 / 65 / 513, the Triton kernel
#    at W 264 / 257 / 17 / 65.
# 2. DDTree rounds at budgets 16 / 64 / 256 / 512, row blocks 16 and 1, side by side in one process.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout 170 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py tests/test_tree_attention.py -k "gpu and (17- or 65- or 513- or 257- or 264-)" 2>&1 | tail -4 | tee $OUT/gpu_tests.log
echo "=== budgets"
timeout 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 16 64 512 --row-block 16 1 --no-profile --out $OUT/rounds_budgets.json > $OUT/rounds_budgets.raw 2>&1; grep -E "^\||rror" $OUT/rounds_budgets.raw
