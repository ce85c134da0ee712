#!/bin/bash
# Twenty-ninth session, call 5: the vocabulary top-k as two Triton kernels (pallas_kernels/top_k.py,
# tree.kernel_top_k, helper session): its compiled kernels against lax.top_k on hard rows; the top-k
# alone and whole trees beside today's preselected_top_k (each checked against lax.top_k / the
# chunked tree before timing); DDTree rounds with it (preselect kernel) beside the default, in
# turns. Then the drafter's attention alone (W 16 x 4 q heads, prefix 4096) at other split counts.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 120 python -m pytest -q -p no:warnings tests/test_top_k_kernel.py -k gpu_ \
  > $OUT/gpu_tests_top_k.log 2>&1
tail -1 $OUT/gpu_tests_top_k.log
timeout -s KILL 150 python -m dflash_jax.bench.top_k_bench --budgets 16 64 256 512 --fanouts 4 --kernel \
  --out $OUT/top_k_kernel.json > $OUT/top_k_kernel.log 2>&1
grep -E "^\||rror" $OUT/top_k_kernel.log | cut -c1-250
timeout -s KILL 260 python -m dflash_jax.bench.spec_round --ctx --budgets 256 512 --preselect auto kernel \
  --interleave 4 --out $OUT/rounds_top_k.json > $OUT/rounds_top_k.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_top_k.log | cut -c1-300
timeout -s KILL 100 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 16 \
  --profile /tmp/prof --iters 40 --reps 7 --budget 90 --hopper-sched t4:tail_split=4 \
  --hopper-sched t8:tail_split=8 --hopper-sched t32:tail_split=32 --hopper-sched s3:stages=3 \
  --out $OUT/drafter_attention.json > $OUT/drafter_attention.log 2>&1
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/drafter_attention.json"))["rows"]:
    for k, v in r.items():
        if k.endswith("_kernels") and k.startswith("hopper"):
            print(k, r.get(k.replace("_kernels", "_kernel_us")), v, r.get("err_" + k[:-8]))
PY
