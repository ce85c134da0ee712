#!/bin/bash
# Twenty-third session, call 3: the gated-activation kernel with its row tiles paired in clusters
# of two that load each weight tile once (Tiles.pair), and persistent (one program per SM taking
# jobs in turn, Tiles.programs), against call 2's kernel and XLA.
# 1. GPU parity (pair, pdl, persistent, partial last tile at 264 rows, padding).
# 2. Alone at 257 rows beside XLA's gate_up + SiLU (bench/gemm_shapes.py), one program per variant.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -q -p no:cacheprovider -p no:warnings tests/test_gate_up_silu.py -k gpu_ 2>&1 \
  | tee $OUT/gpu_tests_gate_up_silu.log | grep -v "^$" | tail -15
timeout -s KILL 330 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts out_in in_out \
  --products gate_up+silu gate_up+silu:kernel gate_up+silu:kernel-pair gate_up+silu:kernel-pair-pdl \
  gate_up+silu:kernel-pair-s4 gate_up+silu:kernel-pair-rows gate_up+silu:kernel-persist \
  gate_up+silu:kernel-pair-persist gate_up+silu:kernel-pair-persist-pdl --out $OUT/gemm_gate_up_silu_pair.json 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tail -20
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
