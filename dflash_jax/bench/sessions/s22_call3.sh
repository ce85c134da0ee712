#!/bin/bash
# Twenty-second session, call 3: the partial block folded into the full-block programs
# (Schedule.fold_tail, attention variant pallas-fold-tail) against today's tail programs.
# Ran at commit e9f5dd7 with its launch constants made Python ints; both were removed after it
# (the round no faster: BENCHMARKS.md, twenty-second session).
# 1. The kernel alone at ctx 4K, W 257 / 513 (each checked against the float32 reference).
# 2. GPU parity of the folded kernel (both grid orders), two pytest processes side by side.
# 3. DDTree(256) rounds, both, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
echo "=== kernel"
timeout 110 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 257 513 --profile /tmp/prof \
  --hopper-sched fold:fold_tail=true --iters 20 --reps 5 --out $OUT/hopper_fold.json 2>&1 \
  | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_fold.log
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "folded_tail_matches" 2>/dev/null | grep "::" > /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout 170 python -m pytest -q -p no:warnings $(cat /tmp/ids$n) 2>&1 | grep -Ev "$F" \
     > $OUT/gpu_tests_fold_$n.log) &
done
wait
tail -n 3 $OUT/gpu_tests_fold_1.log; tail -n 3 $OUT/gpu_tests_fold_2.log
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== rounds"
timeout 170 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-fold-tail --no-profile \
  --interleave 4 --out $OUT/rounds_fold.json > $OUT/rounds_fold.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_fold.raw
