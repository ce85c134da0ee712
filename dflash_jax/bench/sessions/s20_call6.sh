#!/bin/bash
# Twentieth session, call 6: the Hopper kernel from 64 rows as the default (HOPPER_MIN_ROWS 64).
# 1. GPU parity of the fused verify path (qkv epilogue + Hopper kernel) at W 16 and 17 (and the
#    budget-256 widths), and of the kernel at 64 / 68 rows.
# 2. DFlash and DDTree(256) with the default against the old threshold (pallas-min-rows-128), in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout 120 python -m pytest -q -p no:warnings tests/test_qkv_epilogue.py tests/test_tree_attention_hopper.py -k "fused_path or from_64" 2>&1 | tail -2
timeout 240 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 256 --attn-impl auto pallas-min-rows-128 --no-profile \
  --interleave 4 --out $OUT/rounds_min_rows.json > $OUT/rounds_min_rows.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_min_rows.raw
