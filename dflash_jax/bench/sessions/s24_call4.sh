#!/bin/bash
# Twenty-fourth session, call 4: the pingpong gated-activation kernel with one output tile passed
# between its warpgroups, which leaves shared memory for 6 stages (4 -> 5 stages was worth 7 us).
# 1. GPU parity of every kernel case.
# 2. Alone at 257 rows, 5 and 6 stages, beside XLA's gate_up + SiLU in the model's [in, out] layout.
# 3. If the parity passed: DDTree(256) rounds, XLA's MLP against the kernel's (decode_tiles: 6 stages,
#    PDL), with the costliest kernels, then in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -q -p no:cacheprovider -p no:warnings \
  tests/test_gate_up_silu.py -k gpu_ 2>&1 | tee $OUT/gpu_tests.log | grep -v "^$" | tail -6
timeout -s KILL 130 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts in_out \
  --products gate_up+silu gate_up+silu:kernel-pingpong gate_up+silu:kernel-pingpong-s6 \
  gate_up+silu:kernel-pingpong-s6-pdl --out $OUT/gemm_pingpong_s6.json 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -7
if grep -q "passed" $OUT/gpu_tests.log && ! grep -q "failed" $OUT/gpu_tests.log; then
  timeout -s KILL 300 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --mlp xla kernel \
    --kernel-table 14 --interleave 5 --out $OUT/rounds_pingpong_s6.json > $OUT/rounds_pingpong_s6.raw 2>&1
  grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_pingpong_s6.raw
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
