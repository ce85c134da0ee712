#!/bin/bash
# Ran at commit 7ccd0a8: the kernel, its tests and spec_round --tree were removed after this call (they lost).
# Eighteenth session, call 2: the per-depth selection kernel (pallas_kernels/depth_select.py) and
# the preselection's fan-out by k.
# 1. GPU parity: the kernel against its reference; whole trees with it against the XLA tree.
# 2. The top-k alone (chunked, fan-outs 2 / 4 / 8) and whole trees (chunked / default fan-out x
#    depth selection in XLA / kernel) at [15, 151936], budgets 256, 16, 512.
# 3. DDTree(256) rounds: the seventeenth session's tree, the preselection alone, and both with the
#    depth kernel (today's default), side by side in one process, with the kernel table.
# 4. Budgets 16 / 64 / 512: the seventeenth session's tree against today's default.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout 90 python -m pytest -q -p no:warnings tests/test_depth_select.py -k gpu_ 2>&1 | tail -4 | tee $OUT/gpu_tests.log
echo "=== top-k"
timeout 150 python -m dflash_jax.bench.top_k_bench --budgets 256 16 512 --fanouts 2 4 8 --depth-select xla kernel --calls 4 --out $OUT/top_k.json > $OUT/top_k.raw 2>&1; grep -E "^\||rror" $OUT/top_k.raw
echo "=== rounds 256"
timeout 160 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --tree chunked-xla preselect-xla auto --kernel-table 80 --out $OUT/rounds_tree.json > $OUT/rounds_tree.raw 2>&1; grep -E "^\||rror" $OUT/rounds_tree.raw
echo "=== budgets"
timeout 190 python -m dflash_jax.bench.spec_round --ctx --budgets 16 64 512 --tree chunked-xla auto --no-profile --out $OUT/rounds_budgets.json > $OUT/rounds_budgets.raw 2>&1; grep -E "^\||rror" $OUT/rounds_budgets.raw
