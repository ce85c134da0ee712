#!/bin/bash
# Twenty-seventh session, call 8: the verify's gate_up product (36 distinct weights at 257 rows a
# call) run back to back for 8 s after 5 s idle: its first 0.3 s against its last 200 calls,
# with the SM clock, power and throttle reasons of each window (bench/power_cap.py); then the
# same for the LM head's shape (one [257, 4096] x [4096, 151936] product, 8 a call).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
timeout -s KILL 120 python -m dflash_jax.bench.power_cap --out $OUT/power_cap_gate_up.json > $OUT/power_cap_gate_up.log 2>&1
grep -vE "^WARNING|^I0000|^W0000" $OUT/power_cap_gate_up.log | tail -5 | cut -c1-300
timeout -s KILL 120 python -m dflash_jax.bench.power_cap --out-features 151936 --layers 8 --tail 100 \
  --out $OUT/power_cap_lm_head.json > $OUT/power_cap_lm_head.log 2>&1
grep -vE "^WARNING|^I0000|^W0000" $OUT/power_cap_lm_head.log | tail -5 | cut -c1-300
