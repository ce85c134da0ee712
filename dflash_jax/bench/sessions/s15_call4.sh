#!/bin/bash
# Fifteenth session, call 4: DDTree(256) with the residual path as the kernel, as the same ops in XLA (jnp), or
# off (XLA's own split), kernel table; then the new default at budgets 16, 64 and 512 (per-stage split).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --residual kernel jnp xla --kernel-table 40 --out $OUT/rounds_256.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_256.log
echo "=== budgets 16, 64, 512"
timeout 200 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --out $OUT/rounds_budgets.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_budgets.log
