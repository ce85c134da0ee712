#!/bin/bash
# Thirty-second session, call 2: Nsight Compute on the verify's attention at W 257, ctx 4K (the
# Mosaic kernel with the model's schedule, then split_merge), one launch of each after warm-up,
# every section: where the kernel's 33-40 us go (tensor pipe busy, warp stalls, L2 and HBM).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
NCU=/usr/local/cuda/bin/ncu
timeout -s KILL 400 $NCU --kernel-name regex:"mosaic|split_merge" --launch-skip 6 --launch-count 2 --set full \
  -o $OUT/attention_w257 python -m dflash_jax.bench.attention_ncu --ctx 4096 --width 257 --calls 8 \
  > $OUT/ncu_run.log 2>&1
tail -5 $OUT/ncu_run.log | cut -c1-300
$NCU --import $OUT/attention_w257.ncu-rep --page details --print-details all > $OUT/attention_w257_details.txt 2>&1
$NCU --import $OUT/attention_w257.ncu-rep --page raw --csv > $OUT/attention_w257_raw.csv 2>&1
wc -c $OUT/attention_w257_details.txt $OUT/attention_w257_raw.csv
grep -E "^  [a-z_]|Duration|Throughput|Busy|Pipe|Warp Cycles|Issued|Eligible|Active Warps|Registers|Shared Memory Config|Block Limit|Achieved|Hit Rate|Stall|stall|Dynamic Shared|Grid Size|Waves" \
  $OUT/attention_w257_details.txt | head -150 | cut -c1-200
