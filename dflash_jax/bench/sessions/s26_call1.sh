#!/bin/bash
# Twenty-sixth session, call 1: GPU parity of the folded-tail kernel at the review commit
# (b5aedb9: one shared refill, not rerun on a GPU), then whether the host or the GPU sets the
# pace of a DDTree(256) round (bench/host_pace.py: issue time, pipelined calls, per-kernel slack
# between the host's launch and the kernel's start, the host's costliest events).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "folded_tail_matches or (kernel_matches_reference and -257-)" 2>/dev/null | grep "::" > /tmp/ids
wc -l < /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -v -p no:warnings $(cat /tmp/ids$n) 2>&1 \
     | grep -E "PASSED|FAILED|ERROR|passed|failed" > $OUT/gpu_tests_fold_refill_$n.log) &
done
wait
cat $OUT/gpu_tests_fold_refill_1.log $OUT/gpu_tests_fold_refill_2.log | grep -E "passed|failed|FAILED|ERROR"
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== host pace"
timeout -s KILL 300 python -m dflash_jax.bench.host_pace --budget 256 --ctx 4096 --rounds 8 32 \
  --out $OUT/host_pace.json > $OUT/host_pace.log 2>&1
grep -vE "^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn" $OUT/host_pace.log | cut -c1-3000 | tail -40
