#!/bin/bash
# Sixteenth session, call 2: the Hopper GPU tests (the kernel's softmax now scales inside exp2's argument,
# Schedule.fma_scale, and is split into start / softmax / finish), the kernel alone with and without
# fma_scale at ctx 4K, then DDTree(256) rounds with each, side by side in one process.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
JAX_PLATFORMS=cuda timeout 270 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -6 | tee $OUT/gpu_tests.log
echo "=== kernel"
timeout 120 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 272 528 --profile /tmp/prof \
  --hopper-sched scaled:fma_scale=false --iters 20 --reps 5 --out $OUT/hopper_fma.json 2>&1 | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_fma.log
echo "=== rounds"
timeout 180 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas pallas-scaled-scores --kernel-table 12 --out $OUT/rounds_256.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_256.log
