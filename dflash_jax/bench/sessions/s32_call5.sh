#!/bin/bash
# Thirty-second session, call 5: (1) where call 4's ordered turns went in the round: spec_round's
# profiled DDTree(256) rounds with each kernel variant, the Mosaic kernel's own time per round,
# the SM clock and power sampled while each is timed, and the rounds in turns; (2) the Hopper
# kernel's GPU tests (29 cases, now with ordered turns by default) in four processes side by side.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 240 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-unordered-turn \
  --kernel-table 8 --interleave 4 --clocks --out $OUT/rounds_ordered_turn.json > $OUT/rounds_ordered_turn.log 2>&1
grep -E "^\||interleaved|rror|clock|power" $OUT/rounds_ordered_turn.log | cut -c1-300 | tail -14
export XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cpu python -m pytest --collect-only -q -k gpu_ tests/test_tree_attention_hopper.py 2>/dev/null \
  | grep :: > /tmp/all.txt
wc -l < /tmp/all.txt
for k in 0 1 2 3; do
  awk -v k=$k 'NR % 4 == k' /tmp/all.txt > /tmp/part$k.txt
  JAX_PLATFORMS=cuda timeout -s KILL 280 python -m pytest -q -p no:warnings $(cat /tmp/part$k.txt) \
    > $OUT/gpu_tests_hopper_$k.log 2>&1 &
done
wait
for k in 0 1 2 3; do tail -n 1 $OUT/gpu_tests_hopper_$k.log | cut -c1-200; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_hopper_$k.log | cut -c1-250; done
