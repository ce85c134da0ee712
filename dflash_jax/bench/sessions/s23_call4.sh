#!/bin/bash
# Twenty-third session, call 4: the gated-activation kernel in whole DDTree rounds (budgets 256
# and 512, ctx 4K), side by side with XLA's gate_up + SiLU in one process, with the per-stage
# profile and the kernel table, then in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 500 python -m dflash_jax.bench.spec_round --ctx --budgets 256 512 --mlp xla kernel \
  --kernel-table 30 --interleave 5 --out $OUT/rounds_mlp_kernel.json > $OUT/rounds_mlp_kernel.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail|^gaps" $OUT/rounds_mlp_kernel.raw
python - $OUT/rounds_mlp_kernel.json <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    p = r.get("profile") or {}
    print(r["budget"], r.get("mlp"), "round", round(r["round_ms"], 3), "device", round(p.get("device_ms", 0), 3),
          "gap", round(p.get("gap_ms", 0), 3), "verify", round(p.get("by_scope", {}).get("verify", 0), 3))
    for k in (p.get("kernels") or [])[:8]:
        print("   ", k[0][:48], round(k[1], 3), k[2])
PY
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
