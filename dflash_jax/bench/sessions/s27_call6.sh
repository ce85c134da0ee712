#!/bin/bash
# Twenty-seventh session, call 6: the final code's default DDTree(256) round, 8 and 32 rounds a
# call, beside the o/down products' usual XLA path (--residual xla), in turns; the SM clock,
# power (instant where the driver has it) and throttle reasons sampled every 50 ms; then the
# tree tests on the GPU (its default vocabulary preselection and the per-depth barrier).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
F=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active
nvidia-smi --query-gpu=power.draw.instant --format=csv,noheader >/dev/null 2>&1 && F=$F,power.draw.instant
echo "fields $F"
nvidia-smi --query-gpu=$F --format=csv,noheader -lms 50 > $OUT/clocks_final.csv 2>&1 &
SMI=$!
timeout -s KILL 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --no-profile --rounds-per-call 8 32 \
  --residual kernel xla --interleave 4 --out $OUT/rounds_final.json > $OUT/rounds_final.log 2>&1
kill $SMI
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_final.log | cut -c1-300
python - <<'PY'
import collections, os
rows = [l.strip().split(", ") for l in open(os.environ["OUT"] + "/clocks_final.csv") if l.count(",") >= 4]
busy = [x for x in rows if x[4] == "0x0000000000000004" or float(x[2].split()[0]) > 400]
print("samples", len(rows), "busy", len(busy))
if busy:
    clk = sorted(int(x[1].split()[0]) for x in busy)
    print("busy SM clock MHz p10/median/p90", clk[len(clk) // 10], clk[len(clk) // 2], clk[9 * len(clk) // 10])
    print("throttle", collections.Counter(x[4] for x in busy).most_common(3))
    if len(busy[0]) > 5:
        inst = sorted(float(x[5].split()[0]) for x in busy if x[5][0].isdigit())
        if inst:
            print("instant power W p10/median/p90", inst[len(inst) // 10], inst[len(inst) // 2], inst[9 * len(inst) // 10])
PY
JAX_PLATFORMS=cuda timeout -s KILL 200 python -m pytest -q -p no:warnings tests/test_tree.py > $OUT/gpu_tests_tree.log 2>&1
tail -3 $OUT/gpu_tests_tree.log
