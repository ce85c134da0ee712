#!/bin/bash
# Twenty-fourth session, call 2: DDTree(256) rounds with the verify's gated activation by XLA
# (cuBLAS GEMM + Memset + SiLU fusion) and by the pingpong kernel launched as a programmatic
# dependent (decode_tiles: pingpong, pdl), with the per-stage profile and the costliest kernels,
# then in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 400 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --mlp xla kernel \
  --kernel-table 14 --interleave 5 --out $OUT/rounds_pingpong_pdl.json > $OUT/rounds_pingpong_pdl.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_pingpong_pdl.raw
python - $OUT/rounds_pingpong_pdl.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    p = r.get("profile") or {}
    print(r["budget"], r.get("mlp"), "round", round(r["round_ms"], 3), "device", round(p.get("device_ms", 0), 3),
          "gap", round(p.get("gap_ms", 0), 3), "verify", round(p.get("by_scope", {}).get("verify", 0), 3))
    for k in (p.get("kernels") or [])[:10]:
        print("   ", k[0][:48], round(k[1], 3), k[2])
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
