#!/bin/bash
# Twenty-seventh session, call 3: the DDTree(256) round with the tree's per-depth best kept in
# memory (an optimization barrier per level: its select fusions had grown with the depth), with
# one call's kernels in order; the SM clock, power and throttle reasons sampled every 50 ms while
# it runs (is the round paced by the power limit?).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active,clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.hw_slowdown,clocks_throttle_reasons.sw_thermal_slowdown \
  --format=csv,noheader -lms 50 > $OUT/clocks.csv 2>&1 &
SMI=$!
timeout -s KILL 420 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --timeline --interleave 4 \
  --out $OUT/rounds_tree_barrier.json > $OUT/rounds_tree_barrier.log 2>&1
kill $SMI
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_tree_barrier.log | cut -c1-400
python - <<'PY'
import json, os, collections
out = os.environ["OUT"]
d = json.load(open(out + "/rounds_tree_barrier.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["round_ms"], r.get("round_ms_interleaved"), p.get("device_ms"), p.get("gap_ms"), p.get("by_scope"))
rows = [l.strip().split(", ") for l in open(out + "/clocks.csv") if l.count(",") >= 8]
busy = [x for x in rows if float(x[3].split()[0]) > 200]
print("samples", len(rows), "busy (>200 W)", len(busy))
if busy:
    clk = sorted(int(x[1].split()[0]) for x in busy); pw = sorted(float(x[3].split()[0]) for x in busy)
    print("busy clock MHz min/median/max", clk[0], clk[len(clk)//2], clk[-1], "power W", pw[0], pw[len(pw)//2], pw[-1])
    print("throttle active", collections.Counter(x[5] for x in busy).most_common(5))
    print("sw power cap", collections.Counter(x[6] for x in busy).most_common(3), "hw slowdown", collections.Counter(x[7] for x in busy).most_common(3))
PY
