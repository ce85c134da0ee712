#!/bin/bash
# Twentieth session, call 2: the Mosaic attention kernel as a programmatic dependent (PDL), and
# XLA's command buffers for fusions only; where the Memset before each gate_up GEMM comes from.
# 1. How this jax's Mosaic GPU asks for PDL (CompilerParams fields; the lines that name it).
# 2. GPU parity: the Hopper kernel with Schedule.pdl (and the other fields) at W 257 and 272.
# 3. DDTree(256) at W 257: attention as dispatched / with PDL, x XLA as it is / command buffers
#    for fusions, side by side in one process; the dispatched round's HLO comes back.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX=$(python -c 'import jax, os; print(os.path.dirname(jax.__file__))')
python -c "import dataclasses; from jax.experimental.pallas import mosaic_gpu as p; print([f.name for f in dataclasses.fields(p.CompilerParams)])"
grep -n -i "pdl\|griddep" $JAX/experimental/mosaic/gpu/core.py $JAX/_src/pallas/mosaic_gpu/lowering.py $JAX/_src/pallas/mosaic_gpu/core.py | head -30
JAX_PLATFORMS=cuda timeout 150 python -m pytest -q -p no:warnings tests/test_tree_attention_hopper.py -k "gpu and (257 or pdl or 5120-lens0)" 2>&1 | tail -3
echo "=== rounds 256"
timeout 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-pdl \
  --xla-options "" "xla_gpu_enable_command_buffer=FUSION" --kernel-table 30 --dump-hlo /tmp/hlo \
  --out $OUT/rounds_pdl_mosaic.json > $OUT/rounds_pdl_mosaic.raw 2>&1; grep -E "^\||^gaps|^  gap|rror|fail" $OUT/rounds_pdl_mosaic.raw
ls -la /tmp/hlo; cp /tmp/hlo/*_auto_*w257_res-kernel.hlo.txt.gz $OUT/ 2>/dev/null; ls $OUT
