#!/bin/bash
# Thirtieth session, call 3: call 2 again, longer (128 new tokens), its generations timed in turns,
# with a third setting: every command type but the loops (no-loops), to see whether the gain of
# call 2 comes from the loop run as a graph; spec_round's 8-round call with each setting after.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 500 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --command-buffers off all no-loops --iters 7 --out $OUT/decode_loop_cb_turns.json > $OUT/decode_loop_cb_turns.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_cb_turns.log | cut -c1-300
