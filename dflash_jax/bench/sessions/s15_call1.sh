#!/bin/bash
# Fifteenth session, call 1: GPU parity at HEAD (the Hopper refactor of 28c861b was never run on a GPU),
# the verify GEMMs alone in both weight layouts, and a DDTree(256) round's kernel table with its HLO.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
JAX_PLATFORMS=cuda timeout 250 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py tests/test_qkv_epilogue.py tests/test_kv_compact.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -8 | tee $OUT/gpu_tests.log
echo "=== GEMMs"
timeout 150 python -m dflash_jax.bench.gemm_shapes --rows 272 --out $OUT/gemm_272.json 2>&1 | grep -E "^\||Error|error" | tee $OUT/gemm.log
timeout 60 python -m dflash_jax.bench.gemm_shapes --rows 256 288 --products qkv o down --out $OUT/gemm_256.json 2>&1 | grep -E "^\||Error|error" | tee -a $OUT/gemm.log
echo "=== round"
timeout 130 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 90 --dump-hlo $OUT/hlo --out $OUT/round.json 2>&1 | grep "^|" | tee $OUT/round.log
