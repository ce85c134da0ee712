#!/bin/bash
# Twenty-ninth session, call 4: the block-qkv drafter's context rows from one product for all
# layers (DraftParams.context_kv, stacked; each layer's kv_epilogue reads its layer in place)
# where there were five per-layer kv products. GPU parity of the drafter's and the epilogue's GPU
# tests; then DDTree(256) rounds: block-qkv (stacked context kv) beside the plain fused layout
# (per-layer kv products, and the block pass off the fused path), with the profile's commit scope
# the like-for-like part (fc, the context products, their epilogues), in turns. Then the drafter's
# attention alone (W 16 x 4 q heads, prefix 4096) at other split counts / stages.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -q -p no:warnings tests/test_drafter_block_qkv.py \
  tests/test_qkv_epilogue.py -k gpu_ > $OUT/gpu_tests_stacked.log 2>&1
tail -1 $OUT/gpu_tests_stacked.log
timeout -s KILL 240 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --draft-layout block-qkv fused \
  --kernel-table 80 --interleave 4 --out $OUT/rounds_stacked.json > $OUT/rounds_stacked.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_stacked.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_stacked.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r.get("draft_layout"), r["round_ms"], r.get("round_ms_interleaved"), p.get("device_ms"),
          {k: round(v, 4) for k, v in (p.get("by_scope") or {}).items()},
          {k: round(v, 4) for k, v in (p.get("gap_by_scope") or {}).items()}, p.get("kernels_per_call"))
    for k in p.get("kernels") or []:
        if "/commit/" in k[4]:
            print("   ", k[0][:40], round(k[1] * 1000, 1), k[2], k[4][-45:])
PY
timeout -s KILL 150 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 16 \
  --profile /tmp/prof --iters 40 --reps 7 --budget 140 --hopper-sched t4:tail_split=4 \
  --hopper-sched t8:tail_split=8 --hopper-sched t32:tail_split=32 --hopper-sched s3:stages=3 \
  --hopper-sched s4:stages=4 --out $OUT/drafter_attention.json > $OUT/drafter_attention.log 2>&1
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/drafter_attention.json"))["rows"]:
    for k, v in r.items():
        if k.endswith("_kernels") and k.startswith("hopper"):
            print(k, r.get(k.replace("_kernels", "_kernel_us")), v, r.get("err_" + k[:-8]))
PY
