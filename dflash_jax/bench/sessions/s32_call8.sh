#!/bin/bash
# Thirty-second session, call 8: decoding's own loop rested and sustained (call 7 timed
# spec_round's call so). DDTree(256), ctx 4K: (1) 16 new tokens (15 rounds, about 0.15 s after a
# 0.12 s prefill), each generation and each prefill after 1.5 s idle, 8 of each; (2) as before, 128
# new tokens back to back, 5 turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 200 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 16 --rounds-per-check 1 \
  --method ddtree --iters 8 --rest 1.5 --out $OUT/decode_loop_rested.json > $OUT/decode_loop_rested.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_rested.log | cut -c1-300
timeout -s KILL 200 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree --iters 5 --out $OUT/decode_loop_sustained.json > $OUT/decode_loop_sustained.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_sustained.log | cut -c1-300
python - <<'PY'
import json, os
for name in ("rested", "sustained"):
    d = json.load(open(os.path.join(os.environ["OUT"], f"decode_loop_{name}.json")))
    for r in d["rows"]:
        print(name, r["prefill_ms"], r["generation_ms_turns"])
PY
