#!/bin/bash
# Twenty-fifth session, call 2: call 1's folded kernel hung (its warpgroups asked for 2 x 232 +
# 48 registers a thread, more than the launch's 3 x 168: setmaxnreg waited forever); now 224 /
# 56. First one folded parity case alone (the call stops if it fails or hangs), then the rest
# of call 1: parity, the kernel alone, DDTree(256) rounds in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== first case"
JAX_PLATFORMS=cuda timeout -s KILL 90 python -m pytest -q -x -p no:warnings tests/test_tree_attention_hopper.py \
  -k "folded_tail_matches and 2-257-8-4-128-4400-lens0-True-True" 2>&1 | grep -Ev "$F" | tail -n 30 | tee $OUT/gpu_test_fold_first.log
grep -q "1 passed" $OUT/gpu_test_fold_first.log || exit 1
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "folded_tail_matches or (kernel_matches_reference and 257)" 2>/dev/null | grep "::" > /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout -s KILL 120 python -m pytest -q -p no:warnings $(cat /tmp/ids$n) 2>&1 \
     | grep -Ev "$F" > $OUT/gpu_tests_fold_$n.log) &
done
wait
tail -n 8 $OUT/gpu_tests_fold_1.log; tail -n 8 $OUT/gpu_tests_fold_2.log
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== kernel"
timeout -s KILL 100 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 257 513 \
  --profile /tmp/prof --hopper-sched fold:fold_tail=true --iters 20 --reps 5 --out $OUT/hopper_fold.json 2>&1 \
  | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_fold.log
echo "=== rounds"
timeout -s KILL 220 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-fold-tail \
  --no-profile --rounds-per-call 32 --interleave 4 --out $OUT/rounds_fold.json > $OUT/rounds_fold.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_fold.raw
