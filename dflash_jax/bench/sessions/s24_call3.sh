#!/bin/bash
# Twenty-fourth session, call 3: GPU parity of the gated-activation kernels after their shared
# pieces were factored out (_program_jobs, _stream, _k_loop, _activation, _store), and what a
# launch costs by kind of kernel (XLA fusion, Pallas Triton, Pallas Mosaic GPU with and without
# PDL), straight and in a while loop.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout -s KILL 170 python -m pytest -q -p no:cacheprovider -p no:warnings \
  tests/test_gate_up_silu.py tests/test_residual_norm.py -k gpu_ 2>&1 | tee $OUT/gpu_tests.log | grep -v "^$" | tail -6
timeout -s KILL 200 python -m dflash_jax.bench.launch_cost --chain 240 --loop-iters 8 --out $OUT/launch_cost.json 2>&1 \
  | grep -v "^WARNING\|^I0000\|^W0000" | tail -8
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
