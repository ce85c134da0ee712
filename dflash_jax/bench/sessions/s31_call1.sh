#!/bin/bash
# Thirty-first session, call 1: (1) the silu_mul kernel's GPU parity test and (2) its time alone
# against XLA's SiLU fusion at 257 rows; (3) the gate_up product at 257 rows as the model has it,
# as one batched product (gate and up) and as two products, with XLA's defaults and with
# cuBLASLt, to see which of them cuBLAS runs without the Memset it launches before the fused
# product; the autotuner's logs (every algorithm it timed for that product) and its results, for a
# later call that picks the algorithm; (4) DDTree(256) as decoding runs it (command buffers for
# every command type) with XLA's SiLU fusion against the silu_mul kernel, timed in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 120 python -m pytest -q -p no:warnings tests/test_silu_mul.py -k gpu_ \
  > $OUT/gpu_tests_silu_mul.log 2>&1
tail -2 $OUT/gpu_tests_silu_mul.log | cut -c1-300
timeout -s KILL 100 python -m dflash_jax.bench.glue_bench --widths 257 --kernels silu_mul \
  --out $OUT/glue_silu_mul.json > $OUT/glue_silu_mul.log 2>&1
grep -E "^\||rror" $OUT/glue_silu_mul.log | cut -c1-250
for lt in false true; do
  timeout -s KILL 60 python -m dflash_jax.bench.gemm_shapes --rows 257 --products gate_up --layouts in_out \
    --layers 1 --calls 1 --xla-options "xla_gpu_enable_cublaslt=$lt,xla_gpu_dump_autotune_logs_to=$OUT/autotune_logs_lt_$lt.textproto,xla_gpu_dump_autotune_results_to=$OUT/autotune_results_lt_$lt.textproto" \
    > $OUT/autotune_dump_lt_$lt.log 2>&1
  tail -1 $OUT/autotune_dump_lt_$lt.log | cut -c1-200
done
timeout -s KILL 150 python -m dflash_jax.bench.gemm_shapes --rows 257 --products gate_up gate_up:batched gate_up:halves \
  --layouts in_out --layers 36 --calls 3 --xla-options "" "xla_gpu_enable_cublaslt=true" \
  --out $OUT/gemm_gate_up_variants.json > $OUT/gemm_gate_up_variants.log 2>&1
grep -E "^\||rror" $OUT/gemm_gate_up_variants.log | cut -c1-400
timeout -s KILL 280 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree --activation xla kernel --iters 7 --out $OUT/decode_loop_silu_mul.json > $OUT/decode_loop_silu_mul.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_silu_mul.log | cut -c1-300
ls -la $OUT
