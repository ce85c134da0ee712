#!/bin/bash
# Seventeenth session, call 1: the Hopper kernel with pairs of programs sharing their K/V loads by TMA
# multicast (Schedule.multicast, clusters of two SMs), alone at ctx 4K (W 272 and 528, each checked
# against the float32 reference), then DDTree(256) rounds with and without it side by side in one
# process, then the Hopper GPU parity tests (each case now also run with multicast where it fits).
# Run at commit 6cc13d8; the variant was removed after it (no gain).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
timeout 150 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 272 528 --profile /tmp/prof \
  --hopper-sched mc:multicast=true --iters 20 --reps 5 --out $OUT/hopper_mc.json 2>&1 | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_mc.log
echo "kernel bench rc=${PIPESTATUS[0]}"
echo "=== rounds"
timeout 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas pallas-multicast --kernel-table 12 --out $OUT/rounds_256.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_256.log
echo "=== gpu tests"
JAX_PLATFORMS=cuda timeout 220 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py -k "gpu_" 2>&1 | grep -Ev "$F" | tail -8 | tee $OUT/gpu_tests.log
