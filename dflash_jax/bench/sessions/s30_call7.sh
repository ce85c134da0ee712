#!/bin/bash
# Thirtieth session, call 7: call 6's lossless tests again, now that "auto" attention on a GPU
# falls back to the reference for the tiny test models' head size 8 (no kernel takes it): greedy
# DDTree and DFlash against greedy AR on the GPU, float32, the generation as decoding compiles it.
export PYTHONPATH=.:.carry/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 170 python -m pytest -q -p no:warnings tests/test_speculative.py \
  -k "greedy_speculative_equals or at_any_width" > $OUT/gpu_tests_speculative.log 2>&1
tail -4 $OUT/gpu_tests_speculative.log | cut -c1-300
grep -E "^E  " $OUT/gpu_tests_speculative.log | sort | uniq -c | head -8
