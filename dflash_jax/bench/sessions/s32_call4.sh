#!/bin/bash
# Thirty-second session, call 4: the Hopper attention kernel with its turns ordered
# (`Schedule.ordered_turn`, now the default: a compute warpgroup stores its row sums and passes
# its warpgroup barrier before it hands over its turn, so the arrive can no longer be hoisted
# above the exp2s, as call 3's SASS showed it was) against the kernel as before
# ("pallas-unordered-turn"): (1) the kernel alone at W 257, ctx 4K, checked against the float32
# reference; (2) DDTree(256) as decoding runs it, the two timed in turns, same tokens checked.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 150 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 257 \
  --profile /tmp/prof --iters 20 --reps 5 --hopper-sched unordered:ordered_turn=false \
  --out $OUT/attention_ordered_turn.json > $OUT/attention_ordered_turn.log 2>&1
grep -E "^\||rror|hopper" $OUT/attention_ordered_turn.log | cut -c1-250 | tail -12
timeout -s KILL 300 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree --attn-impl auto pallas-unordered-turn --iters 5 --out $OUT/decode_loop_ordered_turn.json \
  > $OUT/decode_loop_ordered_turn.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_ordered_turn.log | cut -c1-300
