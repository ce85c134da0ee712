#!/bin/bash
# Thirtieth session, call 4: with every command type in graphs the host no longer issues each
# kernel, so the Mosaic GPU launches' host cost (bench/launch_cost.py) stops counting. The
# gated-activation kernel (one launch for gate_up + SiLU, no Memset) against XLA's MLP, in the
# generation's own loop (command buffers off / all) and in spec_round with every command type,
# there beside the Hopper attention kernel as a programmatic dependent.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 330 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --command-buffers off all --mlp xla kernel --iters 7 --out $OUT/decode_loop_mlp.json > $OUT/decode_loop_mlp.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_mlp.log | cut -c1-300
timeout -s KILL 230 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --command-buffers all --mlp xla kernel \
  --attn-impl auto pallas-pdl --no-profile --interleave 4 --out $OUT/rounds_cb_mlp.json > $OUT/rounds_cb_mlp.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_cb_mlp.log | cut -c1-300
