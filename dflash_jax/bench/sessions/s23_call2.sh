#!/bin/bash
# Twenty-third session, call 2: the gated-activation kernel (pallas_kernels/gate_up_silu.py).
# 1. GPU parity against the reference (tests/test_gate_up_silu.py -k gpu_).
# 2. Alone at 257 rows beside XLA's gate_up product and gate_up + SiLU (bench/gemm_shapes.py):
#    36 products with distinct weights in one program; kernel time and wall time per product.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gate_up_silu.py -k gpu_ -x 2>&1 \
  | tee $OUT/gpu_tests_gate_up_silu.log | grep -v "^$" | tail -25
timeout 300 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts out_in in_out \
  --products gate_up gate_up+silu gate_up+silu:kernel gate_up+silu:kernel-pdl --out $OUT/gemm_gate_up_silu.json 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tail -20
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
