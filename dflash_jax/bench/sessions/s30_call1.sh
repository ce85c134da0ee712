#!/bin/bash
# Thirtieth session, call 1: today's default DDTree(256) round beside the Hopper attention kernel
# launched as a programmatic dependent (pallas-pdl), then beside XLA's cuDNN GEMM fusions
# (xla_gpu_cudnn_gemm_fusion_level=2: cuDNN plans join the autotuning of XLA's GEMM fusions, the
# drafter's products among them; with xla_gpu_triton_gemm_any=true every product becomes such a
# fusion, the verify's included), each pair timed in turns in one process.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout -s KILL 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-pdl \
  --kernel-table 16 --interleave 4 --out $OUT/rounds_pdl.json > $OUT/rounds_pdl.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_pdl.log | cut -c1-300
timeout -s KILL 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --xla-options "" \
  xla_gpu_cudnn_gemm_fusion_level=2 xla_gpu_cudnn_gemm_fusion_level=2,xla_gpu_triton_gemm_any=true \
  --kernel-table 16 --interleave 3 --out $OUT/rounds_cudnn.json > $OUT/rounds_cudnn.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_cudnn.log | cut -c1-300
