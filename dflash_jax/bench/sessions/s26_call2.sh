#!/bin/bash
# Twenty-sixth session, call 2: call 1's GPU parity failed once, for the folded tail in the heads-major
# grid order at batch 2 (W 257, lens 4096 / 1001; it passed in the twenty-fifth session's call 2).
# The kernel run 20 times on the same inputs per case (bench/kernel_repeat.py: distinct outputs,
# non-finite runs, errors by region), the failing test again with its traceback; then the host's
# time per launch by kind of kernel (bench/host_pace.py).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== repeat"
timeout -s KILL 200 python -m dflash_jax.bench.kernel_repeat --repeats 20 --out $OUT/kernel_repeat.json \
  > $OUT/kernel_repeat.log 2>&1
grep -vE "$F" $OUT/kernel_repeat.log | grep -E "^\||rror" | cut -c1-400
echo "=== failing test"
JAX_PLATFORMS=cuda timeout -s KILL 100 python -m pytest -x -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "folded_tail_matches and 2-257 and True-False" 2>&1 | grep -vE "$F" | grep -E "assert|Error|error|passed|failed|rel_err|^E " | head -30
echo "=== host pace"
timeout -s KILL 200 python -m dflash_jax.bench.host_pace --budget 256 --ctx 4096 --rounds 8 \
  --out $OUT/host_pace_launches.json > $OUT/host_pace_launches.log 2>&1
grep -vE "$F" $OUT/host_pace_launches.log | grep -vE "^\[" | cut -c1-1600 | tail -30
