#!/bin/bash
# Thirty-first session, call 2: the GPU tests at this commit (every kernel's `test_gpu_*` cases,
# and greedy DDTree / DFlash against greedy AR with the generation as decoding compiles it), since
# the thirtieth session's review commit reshaped the model's MLP (one gate_up_product, one
# gated_activation) after its last GPU run; then the verify's products at 256 and 257 rows, to
# put a number on what the tree's root row costs the GEMMs. dflash 0.1.0 and gguf (the tests'
# references) travel as packages in .carry/site.
export PYTHONPATH=.:.carry/site NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 300 python -m pytest -q -p no:warnings -k gpu_ \
  tests/test_drafter_block_qkv.py tests/test_gate_up_silu.py tests/test_kv_compact.py tests/test_qkv_epilogue.py \
  tests/test_residual_norm.py tests/test_silu_mul.py tests/test_split_merge.py tests/test_top_k_kernel.py \
  tests/test_tree_attention.py tests/test_tree_attention_hopper.py > $OUT/gpu_tests_kernels.log 2>&1
tail -2 $OUT/gpu_tests_kernels.log | cut -c1-300
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_kernels.log | head -10 | cut -c1-250
JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -q -p no:warnings tests/test_speculative.py \
  -k "greedy_speculative_equals or at_any_width" > $OUT/gpu_tests_speculative.log 2>&1
tail -2 $OUT/gpu_tests_speculative.log | cut -c1-300
grep -E "^(FAILED|ERROR)" $OUT/gpu_tests_speculative.log | head -10 | cut -c1-250
timeout -s KILL 100 python -m dflash_jax.bench.gemm_shapes --rows 256 257 --products qkv gate_up lm_head \
  --layouts in_out --layers 36 --calls 3 --out $OUT/gemm_rows_256_257.json > $OUT/gemm_rows_256_257.log 2>&1
timeout -s KILL 60 python -m dflash_jax.bench.gemm_shapes --rows 256 257 --products o down \
  --layouts in_out --splits 2 --layers 36 --calls 3 --out $OUT/gemm_rows_256_257_split.json > $OUT/gemm_rows_256_257_split.log 2>&1
grep -hE "^\||rror" $OUT/gemm_rows_256_257.log $OUT/gemm_rows_256_257_split.log | cut -c1-300
