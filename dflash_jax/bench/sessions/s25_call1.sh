#!/bin/bash
# Twenty-fifth session, call 1: the partial block of W 257 folded into the full-block programs'
# memory warpgroups, swap-AB (Schedule.fold_tail, attention variant pallas-fold-tail).
# 1. GPU parity of the folded kernel (both grid orders), two pytest processes side by side.
# 2. The kernel alone at ctx 4K, W 256 / 257 / 513, default and folded (each checked against
#    the float32 reference by the bench).
# 3. DDTree(256) rounds, both, 32 rounds a call, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "folded_tail_matches or (kernel_matches_reference and 257)" 2>/dev/null | grep "::" > /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -q -x -p no:warnings $(cat /tmp/ids$n) 2>&1 \
     | grep -Ev "$F" > $OUT/gpu_tests_fold_$n.log) &
done
wait
tail -n 25 $OUT/gpu_tests_fold_1.log; tail -n 25 $OUT/gpu_tests_fold_2.log
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== kernel"
timeout -s KILL 150 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 256 257 513 \
  --profile /tmp/prof --hopper-sched fold:fold_tail=true --iters 20 --reps 5 --out $OUT/hopper_fold.json 2>&1 \
  | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_fold.log
echo "=== rounds"
timeout -s KILL 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-fold-tail \
  --no-profile --rounds-per-call 32 --interleave 4 --out $OUT/rounds_fold.json > $OUT/rounds_fold.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_fold.raw
