#!/bin/bash
# Thirty-second session, call 3: the SASS of call 2's profile (carried back as
# .carry/ncu/attention_w257.ncu-rep, not profiled again) with its stall samples per instruction:
# which waits (K/V arrival, the pingpong turn, the products) hold the Mosaic kernel's warps.
export PYTHONPATH=. PYTHONUNBUFFERED=1
NCU=/usr/local/cuda/bin/ncu
$NCU --import .carry/ncu/attention_w257.ncu-rep --page source --csv --print-source sass \
  --kernel-name regex:mosaic > $OUT/attention_w257_sass.csv 2> $OUT/sass_err.log
wc -l $OUT/attention_w257_sass.csv; head -c 600 $OUT/sass_err.log
python -m dflash_jax.bench.ncu_sass $OUT/attention_w257_sass.csv --top 45 --context 3 > $OUT/attention_w257_stalls.txt 2>&1
head -c 14000 $OUT/attention_w257_stalls.txt
