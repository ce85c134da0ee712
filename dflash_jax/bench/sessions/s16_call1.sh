#!/bin/bash
# Sixteenth session, call 1: the Hopper kernel with paired products per turn (Schedule.paired_issue) and on
# 64-key blocks with 3-5 in flight, alone at ctx 4K (W 272 and 528; each checked against the float32
# reference), then DDTree(256) rounds with each, side by side in one process.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 260 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 272 528 --profile /tmp/prof \
  --hopper-sched paired:paired_issue=true --hopper-sched bk64s3:block_k=64,stages=3 \
  --hopper-sched bk64s4:block_k=64,stages=4 --hopper-sched bk64s5:block_k=64,stages=5 \
  --hopper-sched bk64s4p:block_k=64,stages=4,paired_issue=true --hopper-sched bk64s5p:block_k=64,stages=5,paired_issue=true \
  --iters 20 --reps 5 --out $OUT/hopper_sched.json 2>&1 | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_sched.log
echo "=== rounds"
timeout 280 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl pallas pallas-paired pallas-bk64 --kernel-table 12 --out $OUT/rounds_256.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_256.log
