#!/bin/bash
# Twenty-first session, call 3 (after call 2's rounds: DDTree(256) 10.99 against 11.45 ms in turns
# with the full-block programs first):
# 1. The kernel alone at ctx 4K, W 257 / 272 / 513, both grid orders, and tail splits 8 / 32
#    (the benchmark's cache now rounds ctx + W up to a multiple of 8, as the model's do).
# 2. The DDTree(256) round with its profile, both orders, in turns.
# 3. GPU parity of the kernel (both orders, every case).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
echo "=== kernel"
timeout 130 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 257 272 513 --profile /tmp/prof \
  --hopper-sched headsmajor:tails_last=false --hopper-sched t8:tail_split=8 --hopper-sched t32:tail_split=32 \
  --iters 20 --reps 5 --out $OUT/hopper_order.json 2>&1 | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_order.log
echo "=== rounds"
timeout 170 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-heads-major \
  --interleave 5 --out $OUT/rounds_order_profile.json > $OUT/rounds_order_profile.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_order_profile.raw
echo "=== parity"
JAX_PLATFORMS=cuda timeout 250 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -4 | tee $OUT/gpu_tests.log
