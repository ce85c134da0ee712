#!/bin/bash
# Twenty-sixth session, call 6 (the last device minutes): does XLA's exclusion of nondeterministic
# algorithms drop the Memset that the gate_up cuBLAS call launches, and at what cost? DDTree(256),
# as it is and with xla_gpu_exclude_nondeterministic_ops=true, in turns, with the kernel table.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 170 python -m dflash_jax.bench.spec_round --ctx --budgets 256 \
  --xla-options "" xla_gpu_exclude_nondeterministic_ops=true --kernel-table 12 --interleave 3 \
  --out $OUT/rounds_exclude_nondet.json > $OUT/rounds_exclude_nondet.raw 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_exclude_nondet.raw | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_exclude_nondet.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(repr(r["xla_options"]), r["round_ms"], p.get("device_ms"), p.get("kernels_per_call"))
    for k in p.get("kernels", [])[:12]:
        print("  ", k[:3])
PY
