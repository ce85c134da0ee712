#!/bin/bash
# Nineteenth session, call 1: DDTree's width at row block 8 against 16 (W 264 against 272 at budget 256).
# 1. GPU parity: the Hopper kernel at W 264 and the fused verify path at W 264 / 272.
# 2. The verify GEMMs alone at 257, 264 and 272 rows (what cuBLAS does with fewer rows).
# 3. DDTree(256) rounds at row blocks 16 and 8, side by side in one process, with the kernel table.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
git log --oneline -1 2>/dev/null
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -p no:warnings tests/test_tree_attention.py tests/test_qkv_epilogue.py -k "gpu" 2>&1 | tail -3 | tee $OUT/gpu_tests.log
echo "=== gemms"
timeout 100 python -m dflash_jax.bench.gemm_shapes --rows 257 264 272 --products qkv gate_up lm_head --layouts in_out --calls 4 --out $OUT/gemm_rows.json > $OUT/gemm_rows.raw 2>&1; grep -E "^\||rror" $OUT/gemm_rows.raw
timeout 80 python -m dflash_jax.bench.gemm_shapes --rows 264 272 --products o down --layouts in_out --splits 2 --calls 4 --out $OUT/gemm_rows_split.json > $OUT/gemm_rows_split.raw 2>&1; grep -E "^\||rror" $OUT/gemm_rows_split.raw
echo "=== rounds 256"
timeout 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --row-block 16 8 --kernel-table 60 --out $OUT/rounds_row_block.json > $OUT/rounds_row_block.raw 2>&1; grep -E "^\||rror" $OUT/rounds_row_block.raw
