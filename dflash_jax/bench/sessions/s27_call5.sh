#!/bin/bash
# Twenty-seventh session, call 5: the drafter's products at its rows with int8 weights (one
# float32 scale per output column) against bf16 ones: does XLA fuse the int8 -> bf16 conversion
# into the GEMM, and does the product then take half the time? (bench/int8_products.py)
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 300 python -m dflash_jax.bench.int8_products --out $OUT/int8_products.json > $OUT/int8_products.log 2>&1
grep -vE "^WARNING|^I0000|^W0000" $OUT/int8_products.log | tail -12 | cut -c1-300
