#!/bin/bash
# Twenty-seventh session, call 1: today's default DDTree(256) round with its whole kernel table and
# one traced call's kernels in order (--timeline), to see where the draft and tree phases and the
# idle time go, kernel by kernel.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 420 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 400 --timeline \
  --out $OUT/rounds_timeline.json > $OUT/rounds_timeline.log 2>&1
grep -E "^\| ddtree|rror|fail" $OUT/rounds_timeline.log | cut -c1-400
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_timeline.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["round_ms"], p.get("device_ms"), p.get("gap_ms"), p.get("by_scope"), p.get("gap_by_scope"))
    print("timeline entries", len(p.get("timeline", [])))
PY
