#!/bin/bash
# Twenty-ninth session, call 6 (the final code): the compiled top-k kernels against the total
# order's reference on the GPU; the top-k alone at k 256 / 512 beside the XLA preselection; then
# DDTree rounds at budgets 16 / 64 / 256 / 512 with today's defaults (the kernel top-k, the stacked
# context kv, the bf16 LM head), with the per-stage profile.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 90 python -m pytest -q -p no:warnings tests/test_top_k_kernel.py -k gpu_ \
  > $OUT/gpu_tests_top_k.log 2>&1
tail -1 $OUT/gpu_tests_top_k.log
timeout -s KILL 120 python -m dflash_jax.bench.top_k_bench --budgets 256 512 --fanouts 4 --radix-prechunks --kernel \
  --out $OUT/top_k_kernel.json > $OUT/top_k_kernel.log 2>&1
grep -E "kernel_us" $OUT/top_k_kernel.log | cut -c1-220
timeout -s KILL 260 python -m dflash_jax.bench.spec_round --ctx --budgets 256 16 64 512 \
  --out $OUT/rounds_final.json > $OUT/rounds_final.log 2>&1
grep -E "^\| ddtree|rror|fail" $OUT/rounds_final.log | cut -c1-300
