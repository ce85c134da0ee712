#!/bin/bash
# Fourteenth session, call 3: GPU parity at HEAD, then the new default against command buffers "all" and the
# thirteenth session's default, then the Hopper kernel's variants alone.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
JAX_PLATFORMS=cuda timeout 170 python -m pytest -q tests/test_tree_attention_hopper.py tests/test_qkv_epilogue.py tests/test_kv_compact.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -8 | tee $OUT/gpu_tests.log
echo "=== rounds: new default, command buffers off / all"
timeout 110 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --no-profile --command-buffers off all --out $OUT/rounds_new.json 2>&1 | grep "^|" | tee $OUT/rounds_new.log
echo "=== rounds: the thirteenth session's default"
timeout 70 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --no-profile --attn-impl pallas-reduced-merge --rank-max 0 --kv-compact xla --out $OUT/rounds_old.json 2>&1 | grep "^|" | tee $OUT/rounds_old.log
echo "=== kernel variants"
timeout 80 python -m dflash_jax.bench.tree_attention_bench --hopper --hopper-variants --contexts 4096 --widths 272 --profile /tmp/prof --iters 20 --reps 5 --out $OUT/hopper_variants.json 2>&1 | grep -E "^  hopper|^ctx=|kernel us" | tee $OUT/hopper_variants.log
