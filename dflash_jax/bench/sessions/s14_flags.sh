#!/bin/bash
# One process per XLA_FLAGS variant (XLA's autotune cache is per process), DDTree(256) at ctx 4K.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
i=0
for f in "" "--xla_gpu_enable_triton_gemm=false" "--xla_gpu_enable_split_k_autotuning=false" "--xla_gpu_enable_cublaslt=true" "--xla_gpu_exhaustive_tiling_search=true"; do
  i=$((i+1))
  echo "=== variant $i XLA_FLAGS='$f'"
  XLA_FLAGS="$f" timeout ${T:-105} python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 25 --out $OUT/flags_$i.json 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -45
done
