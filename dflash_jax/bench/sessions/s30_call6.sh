#!/bin/bash
# Thirtieth session, call 6 (the final code: DDTree and DFlash decoding compile with command buffers
# for every command type): the lossless tests on the GPU (greedy DDTree and DFlash against greedy
# AR, float32, the generation as decoding compiles it; dflash 0.1.0 and gguf travel in .carry/site),
# then the generation's own loop as decoding compiles it against command buffers off, in turns.
export PYTHONPATH=.:.carry/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 170 python -m pytest -q -p no:warnings tests/test_speculative.py \
  -k "greedy_speculative_equals or at_any_width" > $OUT/gpu_tests_speculative.log 2>&1
tail -3 $OUT/gpu_tests_speculative.log
timeout -s KILL 300 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree dflash --command-buffers decoding off --iters 5 --out $OUT/decode_loop_final.json \
  > $OUT/decode_loop_final.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_final.log | cut -c1-300
