#!/bin/bash
# Twenty-sixth session, call 3: the Hopper kernel with `next_bias` (the warpgroup synced before
# the next bias block is copied over the tile it has read): 20 runs per case (bench/kernel_repeat.py),
# GPU parity (the new same-bits test, every folded case, the default path at W 257 / 65 / 513);
# then a round as decoding runs it: the generation's while loop reading `done` every 1 / 4 / 8
# rounds against spec_round's 8-round fori_loop (bench/decode_loop.py).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
F='^WARNING|^I0000|^W0000|DeprecationWarning|warnings.warn'
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
echo "=== repeat"
timeout -s KILL 150 python -m dflash_jax.bench.kernel_repeat --repeats 20 --out $OUT/kernel_repeat.json \
  > $OUT/kernel_repeat.log 2>&1
grep -vE "$F" $OUT/kernel_repeat.log | grep -E "^\||rror" | cut -c1-400
echo "=== parity"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings tests/test_tree_attention_hopper.py \
  -k "same_bits or folded_tail_matches or (kernel_matches_reference and (-257- or -65- or -513-))" \
  2>/dev/null | grep "::" > /tmp/ids
wc -l < /tmp/ids
awk 'NR % 2 == 1' /tmp/ids > /tmp/ids1
awk 'NR % 2 == 0' /tmp/ids > /tmp/ids2
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.4
for n in 1 2; do
  (JAX_PLATFORMS=cuda timeout -s KILL 175 python -m pytest -v -p no:warnings $(cat /tmp/ids$n) 2>&1 \
     | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " > $OUT/gpu_tests_next_bias_$n.log) &
done
wait
cat $OUT/gpu_tests_next_bias_1.log $OUT/gpu_tests_next_bias_2.log | grep -E "passed|failed|FAILED|ERROR" | head
unset XLA_PYTHON_CLIENT_MEM_FRACTION
echo "=== decode loop"
timeout -s KILL 240 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 64 \
  --rounds-per-check 1 4 8 --out $OUT/decode_loop.json > $OUT/decode_loop.log 2>&1
grep -vE "$F" $OUT/decode_loop.log | grep -E "^\||rror|^\[|H200" | cut -c1-400 | tail -16
