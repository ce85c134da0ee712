#!/bin/bash
# Thirty-second session, call 7: what the 700 W limit costs a DDTree(256) round. The same compiled
# 8-round call (as decoding compiles DDTree), timed after 1.5 s of rest each, then back to back for
# 4 s, then rested again, with the SM clock and power sampled in each phase.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 200 python -m dflash_jax.bench.power_headroom --budget 256 --ctx 4096 --calls 8 --rest 1.5 \
  --sustain 4 --out $OUT/power_headroom.json > $OUT/power_headroom.log 2>&1
grep -E "^\||rror" $OUT/power_headroom.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "power_headroom.json")))
for r in d["rows"]:
    print(r["phase"], r["ms_per_round_all"][:16])
PY
