#!/bin/bash
# Twentieth session, call 5: the Hopper kernel from 64 rows per kv head ("pallas-hopper-64"):
# DFlash's verify (W 16) and drafter pass, and DDTree(16) at W 17, which "pallas" leaves to the
# Triton kernel (call 4: DDTree(16) at W 17 6.94 ms against 6.67 at W 32, whose 128 rows take the
# Hopper kernel). GPU parity first, then the rounds in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout 100 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py -k "from_64" 2>&1 | tail -2
timeout 300 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 16 --attn-impl auto pallas-hopper-64 --no-profile \
  --interleave 4 --out $OUT/rounds_hopper64.json > $OUT/rounds_hopper64.raw 2>&1
grep -E "^\||^interleaved|rror|fail" $OUT/rounds_hopper64.raw
