#!/bin/bash
# Fifteenth session, call 2: GPU parity of the residual_norm and split_merge kernels (and the fused forward
# through both), the verify GEMMs as K slices, then DDTree rounds side by side: residual kernel / XLA x
# merge kernel / XLA (budget 256, kernel table), and the residual kernel / XLA at budget 64.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -p no:warnings tests/test_residual_norm.py tests/test_split_merge.py tests/test_qkv_epilogue.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -8 | tee $OUT/gpu_tests.log
echo "=== GEMMs as K slices"
timeout 80 python -m dflash_jax.bench.gemm_shapes --rows 272 --products qkv o down --layouts in_out --splits 1 2 4 --out $OUT/gemm_splits.json 2>&1 | grep -E "^\||Error" | tee $OUT/gemm_splits.log
echo "=== rounds, budget 256"
timeout 230 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas pallas-xla-merge --residual kernel xla --kernel-table 40 --out $OUT/rounds_256.json 2>&1 | grep "^|" | tee $OUT/rounds_256.log
echo "=== rounds, budget 64 and 512"
timeout 120 python -m dflash_jax.bench.spec_round --ctx --budgets 64 512 --no-profile --residual kernel xla --out $OUT/rounds_64_512.json 2>&1 | grep "^|" | tee $OUT/rounds_64_512.log
