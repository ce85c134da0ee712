#!/bin/bash
# Twenty-ninth session, call 7: the drafter's attention alone (W 16 x 4 q heads = 64 rows a kv head,
# prefix 4096, the Hopper kernel's tail programs) at other split counts than the default 16, each
# checked against the float32 reference; calls 4-5 had stopped on a stages variant that exceeds
# the shared memory.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 150 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 16 \
  --profile /tmp/prof --iters 40 --reps 7 --budget 120 --hopper-sched t4:tail_split=4 \
  --hopper-sched t8:tail_split=8 --hopper-sched t32:tail_split=32 \
  --out $OUT/drafter_attention.json > $OUT/drafter_attention.log 2>&1
tail -3 $OUT/drafter_attention.log | cut -c1-300
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/drafter_attention.json"))["rows"]:
    for k, v in r.items():
        if k.endswith("_kernels") and (k.startswith("hopper") or k.startswith("pallas")):
            print(k, round(r.get(k.replace("_kernels", "_kernel_us")), 2), v, r.get("err_" + k[:-8]))
PY
