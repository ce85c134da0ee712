#!/bin/bash
# Fifteenth session, call 3: the glue kernels' block settings against XLA; DDTree(256) with the drafter's
# cache written in place, new default against the fourteenth session's glue (kernel table); and the same
# default compiled with XLA's GEMM autotuning off (cuBLAS's own pick), in a process of its own.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
timeout 150 python -m dflash_jax.bench.glue_bench --widths 272 --out $OUT/glue.json 2>&1 | grep -E "^\||Error" | tee $OUT/glue.log
echo "=== rounds, budget 256"
timeout 150 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas pallas-xla-merge --residual kernel xla --kernel-table 40 --out $OUT/rounds_256.json 2>&1 | grep "^|" | tee $OUT/rounds_256.log
echo "=== rounds, budget 256, autotune level 0"
XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 90 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 40 --out $OUT/rounds_256_at0.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_256_at0.log
