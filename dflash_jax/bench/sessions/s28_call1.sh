#!/bin/bash
# Twenty-eighth session, call 1: what the 257th token costs the Hopper attention kernel, on one
# machine. The kernel alone (each checked against the float32 reference) at W 256 / 257 and
# prefix 4000 / 4096: at 4096, W 257 spans 35 key blocks (2 splits of 18 + 17) and W 256 34;
# at 4000 both span 34. The default (folded tail) beside the tail programs. Then W 16 (the
# drafter's 64 rows) at 4096.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 300 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4000 4096 --widths 256 257 16 \
  --profile /tmp/prof --hopper-sched tails:tails_last=true --iters 40 --reps 7 --budget 280 \
  --out $OUT/hopper_tail_cost.json > $OUT/hopper_tail_cost.log 2>&1
grep -E "hopper|ctx=|kernel us|rror" $OUT/hopper_tail_cost.log | cut -c1-400
