#!/bin/bash
# Thirty-first session, call 4: the Hopper kernel's GPU tests that call 3 did not reach (it passed
# the first 7 of 29 before its time limit), in three processes side by side (their compiles run on
# the CPU cores).
export PYTHONPATH=.:.carry/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cpu python -m pytest --collect-only -q -k gpu_ tests/test_tree_attention_hopper.py 2>/dev/null \
  | grep :: | tail -n +8 > /tmp/rest.txt
wc -l < /tmp/rest.txt
for k in 0 1 2; do
  awk -v k=$k 'NR % 3 == k' /tmp/rest.txt > /tmp/part$k.txt
  JAX_PLATFORMS=cuda timeout -s KILL 330 python -m pytest -q -p no:warnings $(cat /tmp/part$k.txt) \
    > $OUT/gpu_tests_hopper_rest_$k.log 2>&1 &
done
wait
for k in 0 1 2; do tail -1 $OUT/gpu_tests_hopper_rest_$k.log | cut -c1-200; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_hopper_rest_$k.log | cut -c1-250; done
