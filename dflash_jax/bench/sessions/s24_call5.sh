#!/bin/bash
# Twenty-fourth session, call 5: can the host queue Mosaic GPU launches behind running work? The
# launch-cost chains again, each also behind a long matrix product it depends on (the time until
# the call returns), and the pingpong kernel alone at 5 and 6 stages beside XLA's gate_up + SiLU
# (call 4 timed XLA's in the [in, out] layout, where gemm_shapes runs no kernel variant).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 200 python -m dflash_jax.bench.launch_cost --chain 240 --loop-iters 8 --out $OUT/launch_cost_lead.json 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tail -6
timeout -s KILL 150 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts out_in \
  --products gate_up+silu gate_up+silu:kernel-pingpong gate_up+silu:kernel-pingpong-s6 \
  gate_up+silu:kernel-pingpong-s6-pdl --out $OUT/gemm_pingpong_s6.json 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tail -7
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
