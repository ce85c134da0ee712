#!/bin/bash
# Thirty-second session, call 1: what the verify's and the drafter's products gain when their
# weights are already in L2. Each product as XLA compiles it, with 36 distinct weights a program
# (cold: as in the round, where each weight was last read a round ago) and with one weight read
# call after call (hot: the weight stays in L2 between calls when it fits, 50 MB). If the o
# product (33.5 MB of weights) runs much faster hot, the attention kernel before it could warm
# L2 with those weights (its K/V stream leaves HBM mostly idle); if not, that idea is dead.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
which ncu nsys 2>&1 | head -3
for layers in 36 1; do
  timeout -s KILL 100 python -m dflash_jax.bench.gemm_shapes --rows 257 --products o down \
    --layouts in_out --splits 2 --layers $layers --calls 5 --out $OUT/gemm_l2_split_$layers.json \
    > $OUT/gemm_l2_split_$layers.log 2>&1
  timeout -s KILL 100 python -m dflash_jax.bench.gemm_shapes --rows 257 16 --products qkv o gate_up down \
    --layouts in_out --layers $layers --calls 5 --out $OUT/gemm_l2_$layers.json > $OUT/gemm_l2_$layers.log 2>&1
  echo "== layers $layers"
  grep -hE "^\||rror" $OUT/gemm_l2_split_$layers.log $OUT/gemm_l2_$layers.log | cut -c1-260
done
