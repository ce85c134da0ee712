#!/bin/bash
# Twenty-seventh session, call 2: how much of the measured DDTree(256) round is the once-per-call
# cost (the host's turn between calls, and the first round's draft and tree launched no faster
# than the host issues them): the same round program at 1, 2, 8 and 32 rounds a call, no
# profiler, then in turns; then the generation's own loop (decode_loop, done read every round).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
timeout -s KILL 330 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --no-profile \
  --rounds-per-call 1 2 8 32 --interleave 4 --out $OUT/rounds_per_call.json > $OUT/rounds_per_call.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_per_call.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_per_call.json"))
for r in d["rows"]:
    print(r["rounds_per_call"], round(r["round_ms"], 3), r.get("round_ms_interleaved"), r.get("round_ms_turns"))
PY
timeout -s KILL 200 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 64 --rounds-per-check 1 \
  --out $OUT/decode_loop.json > $OUT/decode_loop.log 2>&1
grep -vE "^WARNING|^I0000|^W0000" $OUT/decode_loop.log | tail -8 | cut -c1-300
