#!/bin/bash
# Twenty-fourth session, call 8: GPU parity of the final gated-activation kernels (the K loop now
# frees its own slots) and of residual_norm.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 170 python -m pytest -q -p no:cacheprovider -p no:warnings \
  tests/test_gate_up_silu.py tests/test_residual_norm.py -k gpu_ 2>&1 | tee $OUT/gpu_tests.log | grep -v "^$" | tail -6
