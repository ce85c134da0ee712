#!/bin/bash
# Twenty-fifth session, call 3: the folded tail as the default ("pallas"; the old schedule is
# "pallas-tail-programs"). GPU parity of the default path where it folds (W 257 / 65 / 513 and
# each variant of those cases) and of the folded cases call 2's time limit cut, then DDTree(256)
# with its kernel table, both schedules, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "(kernel_matches_reference and (-257- or -65- or -513-)) or (folded_tail_matches and (129 or 264 or 4376))" \
  2>/dev/null | grep "::" > /tmp/ids
wc -l < /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout -s KILL 170 python -m pytest -v -p no:warnings $(cat /tmp/ids$n) 2>&1 \
     | grep -E "PASSED|FAILED|ERROR|passed|failed" > $OUT/gpu_tests_default_fold_$n.log) &
done
wait
cat $OUT/gpu_tests_default_fold_1.log $OUT/gpu_tests_default_fold_2.log | grep -E "passed|failed|FAILED|ERROR"
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== rounds"
timeout -s KILL 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-tail-programs \
  --kernel-table 14 --interleave 4 --out $OUT/rounds_default_fold.json > $OUT/rounds_default_fold.raw 2>&1
grep -E "^\| ddtree|^interleaved|entry_mosaic|split_merge|rror|fail" $OUT/rounds_default_fold.raw | cut -c1-400
