#!/bin/bash
# Twenty-seventh session, call 4: a round as decoding runs it, the generation's loop pipelined
# (SpecSettings.pipelined: verify-accept-commit, then the next round's draft) against whole
# rounds (spec_round as one unit), done read every round; each twice, in turns; with the tree's
# per-depth optimization barrier in both.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 400 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 64 --rounds-per-check 1 \
  --loop whole pipelined whole pipelined --iters 5 --out $OUT/decode_loop_pipelined.json > $OUT/decode_loop_pipelined.log 2>&1
grep -vE "^WARNING|^I0000|^W0000" $OUT/decode_loop_pipelined.log | tail -9 | cut -c1-300
