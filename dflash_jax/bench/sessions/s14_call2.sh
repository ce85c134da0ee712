#!/bin/bash
# Fourteenth session, call 2: GPU parity of the new Hopper paths, then DDTree(256) rounds side by side (ctx 4K).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
JAX_PLATFORMS=cuda timeout 190 python -m pytest -q -x tests/test_tree_attention_hopper.py tests/test_qkv_epilogue.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -6 | tee $OUT/gpu_tests.log
echo "=== A: new default and its parts"
timeout 230 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas pallas-no-pingpong pallas-reduced-merge --kernel-table 40 --out $OUT/rounds_a.json 2>&1 | grep "^|" | tee $OUT/rounds_a.log
echo "=== B: the thirteenth session's default"
timeout 100 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas-reduced-merge --rank-max 0 --kv-compact xla --kernel-table 40 --out $OUT/rounds_b.json 2>&1 | grep "^|" | tee $OUT/rounds_b.log
echo "=== C: command buffers of every type"
timeout 100 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --command-buffers all --kernel-table 40 --out $OUT/rounds_c.json 2>&1 | grep -Ev "$F" | tail -4
