#!/bin/bash
# Thirtieth session, call 5 (DDTree decoding now compiles with command buffers for every command
# type, speculative.DDTREE_COMPILER_OPTIONS): the generation's own loop as decoding compiles it
# against command buffers off (DDTree), and XLA's default against every command type (DFlash),
# timed in turns; then the lossless tests (greedy speculative against greedy AR, DDTree and DFlash)
# on the GPU, with the generation as decoding now compiles it. dflash 0.1.0 (the tests' drafter
# reference) travels as its package in .carry/site.
export PYTHONPATH=.:.carry/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 380 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree dflash --command-buffers decoding off all --iters 5 --out $OUT/decode_loop_final.json \
  > $OUT/decode_loop_final.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_final.log | cut -c1-300
JAX_PLATFORMS=cuda timeout -s KILL 180 python -m pytest -q -p no:warnings tests/test_speculative.py \
  -k "greedy_speculative_equals or at_any_width" > $OUT/gpu_tests_speculative.log 2>&1
tail -3 $OUT/gpu_tests_speculative.log
