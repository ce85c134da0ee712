#!/bin/bash
# Twenty-fourth session, call 1: the gated-activation kernel with its two compute warpgroups taking
# jobs in turn (Tiles.pingpong: one's activation and store overlap the other's products).
# 1. GPU parity of the kernel (all cases, pingpong among them) and of residual_norm (its padded-row
#    mask was fixed after the twenty-third session's GPU runs and not run on a GPU since).
# 2. Alone at 257 rows beside XLA's gate_up + SiLU and the twenty-third session's variants.
# 3. If the pingpong cases passed: DDTree(256) rounds, XLA's MLP against the kernel's, then in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout -s KILL 170 python -m pytest -q -p no:cacheprovider -p no:warnings \
  tests/test_gate_up_silu.py tests/test_residual_norm.py -k gpu_ 2>&1 | tee $OUT/gpu_tests.log | grep -v "^$" | tail -12
timeout -s KILL 130 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts out_in \
  --products gate_up+silu gate_up+silu:kernel-pair gate_up+silu:kernel-pingpong gate_up+silu:kernel-pingpong-pdl \
  gate_up+silu:kernel-pingpong-s4 --out $OUT/gemm_pingpong.json 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -9
if grep -q "passed" $OUT/gpu_tests.log && ! grep -q "failed" $OUT/gpu_tests.log; then
  timeout -s KILL 270 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --mlp xla kernel \
    --interleave 4 --out $OUT/rounds_pingpong.json > $OUT/rounds_pingpong.raw 2>&1
  grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_pingpong.raw
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
