#!/bin/bash
# Twentieth session, call 3: the candidates of calls 1-2 timed in turns (spec_round --interleave),
# so that drift over the run falls on all alike.
# 1. DDTree(256) at W 257: attention as dispatched / with PDL x XLA as it is / command buffers for
#    fusions / legacy cuBLAS instead of cuBLASLt (the Memset before each gate_up GEMM).
# 2. The same round at 32 rounds per call, XLA as it is / fusion command buffers (what a command
#    buffer costs per call, against decoding's one call for all rounds).
# 3. Budgets 16 / 64 / 512 at W = 1 + budget, XLA as it is / fusion command buffers.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
FUS="xla_gpu_enable_command_buffer=FUSION"
echo "=== rounds 256"
timeout 250 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-pdl \
  --xla-options "" "$FUS" "xla_gpu_enable_cublaslt=false" --interleave 5 \
  --out $OUT/rounds_256.json > $OUT/rounds_256.raw 2>&1; grep -E "^\||^interleaved|^gaps|rror|fail" $OUT/rounds_256.raw
echo "=== rounds 256, 32 a call"
timeout 120 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --rounds-per-call 32 --no-profile \
  --xla-options "" "$FUS" --interleave 5 \
  --out $OUT/rounds_256_r32.json > $OUT/rounds_256_r32.raw 2>&1; grep -E "^\||^interleaved|rror|fail" $OUT/rounds_256_r32.raw
echo "=== budgets"
timeout 200 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --no-profile \
  --xla-options "" "$FUS" --interleave 3 \
  --out $OUT/rounds_budgets.json > $OUT/rounds_budgets.raw 2>&1; grep -E "^\||^interleaved|rror|fail" $OUT/rounds_budgets.raw
