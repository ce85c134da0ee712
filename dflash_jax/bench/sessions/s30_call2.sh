#!/bin/bash
# Thirtieth session, call 2: a round as decoding runs it (the generation's while_loop, whose
# condition the host reads back each round) with XLA's command buffers off, as decoding compiles
# it, and with every command type on (WHILE and CONDITIONAL among them: a loop XLA can run as a
# CUDA graph with conditional nodes needs no host read); beside spec_round's 8-round call.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 420 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 64 --rounds-per-check 1 \
  --command-buffers off all --iters 5 --out $OUT/decode_loop_cb.json > $OUT/decode_loop_cb.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_cb.log | cut -c1-300
