#!/bin/bash
# Twenty-sixth session, call 4: today's default DDTree(256) round (the bias copy synced) with its
# kernel table (60 kernels: which op the Memset before gate_up serves) and the compiled HLO;
# beside it, in turns, the Mosaic kernel launched as a programmatic dependent (pallas-pdl).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 400 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --attn-impl auto pallas-pdl \
  --kernel-table 60 --interleave 4 --dump-hlo $OUT/hlo --out $OUT/rounds_default.json > $OUT/rounds_default.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_default.raw | cut -c1-400
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_default.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["attn_impl"], r["round_ms"], p.get("device_ms"), p.get("gap_ms"), p.get("by_scope"))
    for k in p.get("kernels", []):
        if "emset" in k[0] or "Memcpy" in k[0]:
            print("  ", k)
PY
ls -la $OUT/hlo | head
