#!/bin/bash
# Seventeenth session, calls 2 and 3: DDTree(256) and DFlash rounds with the drafter's projections fused
# (drafter.fuse_draft_projections) beside the separate ones, side by side in one process, with the
# kernel table; then budgets 16 / 64 / 512 with the new default. Call 2 ran it at commit 2db386d (the
# drafter fused as the target is: one qkv weight, the context's k/v sliced out of it); call 3 with
# the drafter's own layout (q apart, kv fused, gate_up fused).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 300 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 256 --draft-layout fused separate --kernel-table 40 --out $OUT/rounds_draft_layout.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_draft_layout.log
echo "=== budgets"
timeout 240 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --no-profile --out $OUT/rounds_budgets.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_budgets.log
