#!/bin/bash
# Twenty-second session, call 1 (the grid with every full-block program first is the default since
# the twenty-first session; its GPU parity runs were cut by their time limits before a summary):
# 1. GPU parity: every GPU test of the Hopper kernel (both grid orders and its other variants in
#    every case), the qkv epilogue's and the split-K merge's, in two pytest processes side by side.
# 2. The kernel alone at ctx 4K, W 256 (whole blocks) / 257 (a 4-row tail) / 513, both orders:
#    what the tail costs.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  tests/test_qkv_epilogue.py tests/test_split_merge.py -k "gpu_" 2>/dev/null | grep "::" > /tmp/ids
wc -l < /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout 380 python -m pytest -q -p no:warnings $(cat /tmp/ids$n) 2>&1 | grep -Ev "$F" \
     > $OUT/gpu_tests_$n.log) &
done
wait
tail -5 $OUT/gpu_tests_1.log $OUT/gpu_tests_2.log
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== kernel"
timeout 170 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 256 257 513 --profile /tmp/prof \
  --hopper-sched headsmajor:tails_last=false --iters 20 --reps 5 --out $OUT/hopper_tail.json 2>&1 \
  | grep -E "hopper|ctx=|rror" | tee $OUT/hopper_tail.log
