#!/bin/bash
# Twentieth session, call 1: where a DDTree(256) round's idle time sits (bench.profile.gap_pairs),
# and whether XLA's programmatic dependent launch (PDL) is on and matters.
# 1. The XLA flags of this jaxlib that name PDL; what of it the installed Pallas knows.
# 2. DDTree(256) at W 257 with XLA as it is, without PDL (and without PDL launches, where that
#    flag exists), and at W 264, side by side in one process, with the kernel table and gap pairs.
# 3. DDTree(16) at W 17 and W 24 again (the nineteenth session's 8.99 ms outlier at W 17).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
XLA_FLAGS=--help timeout 60 python -c "import jax; jax.numpy.zeros(1)" > $OUT/xla_help.txt 2>&1
grep -i -E "pdl|dependent_launch" $OUT/xla_help.txt | head -20
grep -rl -E "griddepcontrol|uses_pdl|use_pdl" "$(python -c 'import jax, os; print(os.path.dirname(jax.__file__))')" | head
echo "=== rounds 256"
timeout 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --row-block 1 \
  --xla-options "" "xla_gpu_enable_pdl=false" "xla_gpu_enable_pdl_launch=false" --kernel-table 40 \
  --out $OUT/rounds_pdl.json > $OUT/rounds_pdl.raw 2>&1; grep -E "^\||^gaps|^  gap|rror|fail" $OUT/rounds_pdl.raw
echo "=== budget 16"
timeout 150 python -m dflash_jax.bench.spec_round --ctx --budgets 16 --row-block 1 8 --no-profile \
  --out $OUT/rounds_b16.json > $OUT/rounds_b16.raw 2>&1; grep -E "^\||rror" $OUT/rounds_b16.raw
