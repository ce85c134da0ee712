#!/bin/bash
# Thirty-second session, call 6: call 4's decoding-loop comparison again on another machine, the
# order in each turn swapped (the default, unordered, timed first this time), 7 turns: does the ordered
# kernel gain anything in DDTree(256) rounds as decoding runs them?
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 400 python -m dflash_jax.bench.decode_loop --budget 256 --ctx 4096 --new 128 --rounds-per-check 1 \
  --method ddtree --attn-impl auto pallas-ordered-turn --iters 7 --out $OUT/decode_loop_ordered_turn_swapped.json \
  > $OUT/decode_loop_ordered_turn_swapped.log 2>&1
grep -E "^\||rror|fail" $OUT/decode_loop_ordered_turn_swapped.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.path.join(os.environ["OUT"], "decode_loop_ordered_turn_swapped.json")))
for r in d["rows"]:
    print(r["attn_impl"], r["generation_ms_turns"])
PY
