#!/bin/bash
# Thirty-first session, call 3: the rest of call 2's kernel GPU tests (call 2 passed the first 60,
# through test_split_merge.py, before its time limit): the top-k, Triton and Hopper attention kernels.
export PYTHONPATH=.:.carry/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 420 python -m pytest -q -p no:warnings -k gpu_ \
  tests/test_top_k_kernel.py tests/test_tree_attention.py tests/test_tree_attention_hopper.py \
  > $OUT/gpu_tests_kernels_rest.log 2>&1
tail -2 $OUT/gpu_tests_kernels_rest.log | cut -c1-300
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_kernels_rest.log | head -10 | cut -c1-250
