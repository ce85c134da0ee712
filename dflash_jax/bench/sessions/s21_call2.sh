#!/bin/bash
# Twenty-first session, call 2: the Hopper kernel's grid with every full-block program before any
# tail program (Schedule.tails_last, new default) against the grid ordered by kv head
# (pallas-heads-major, the old order).
# 1. GPU parity of the kernel (both orders, every case).
# 2. The kernel alone at ctx 4K, W 257 / 272 / 513 / 65, both orders, and tail splits 8 / 32.
# 3. DDTree rounds at budgets 256 / 64 / 512 and DFlash, both orders, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -4 | tee $OUT/gpu_tests.log
echo "=== kernel"
timeout 150 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 257 272 513 65 --profile /tmp/prof \
  --hopper-sched headsmajor:tails_last=false --hopper-sched t8:tail_split=8 --hopper-sched t32:tail_split=32 \
  --iters 20 --reps 5 --out $OUT/hopper_order.json 2>&1 | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_order.log
echo "=== rounds"
timeout 300 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 256 64 512 --attn-impl auto pallas-heads-major --no-profile \
  --interleave 4 --out $OUT/rounds_order.json > $OUT/rounds_order.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_order.raw
