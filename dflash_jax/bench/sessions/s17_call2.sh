#!/bin/bash
# Seventeenth session, call 2: DDTree(256) and DFlash rounds with the drafter's projections fused
# (drafter.fuse_draft_projections: q/k/v one GEMM, gate/up one, the context's k/v one) beside the
# separate ones, side by side in one process, with the kernel table; then budgets 16 / 64 / 512 with
# the new default.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout 300 python -m dflash_jax.bench.spec_round --ctx 4096 --budgets 256 --draft-layout fused separate --kernel-table 40 --out $OUT/rounds_draft_layout.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_draft_layout.log
echo "=== budgets"
timeout 240 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --no-profile --out $OUT/rounds_budgets.json 2>&1 | grep -E "^\||rror" | tee $OUT/rounds_budgets.log
