#!/bin/bash
# Thirty-first session, call 5: (1) plain AR decoding's own loop (generate_ar, a while_loop that
# reads `done` back every token) as it compiles today (XLA's default command buffers) against
# command buffers for every command type, the loop types included, timed in turns; (2) call 1's
# DDTree(256) comparison of the silu_mul kernel against XLA's SiLU fusion on another machine, with
# the kernel timed first in each turn this time (call 1 timed XLA's first).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 140 python -m dflash_jax.bench.decode_loop --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ar --command-buffers decoding all --iters 7 --out $OUT/decode_loop_ar_cb.json > $OUT/decode_loop_ar_cb.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_ar_cb.log | cut -c1-300
timeout -s KILL 190 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree --activation kernel xla --iters 5 --out $OUT/decode_loop_silu_mul_swapped.json \
  > $OUT/decode_loop_silu_mul_swapped.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_silu_mul_swapped.log | cut -c1-300
