#!/bin/bash
# Twenty-ninth session, call 2: call 1 showed a float32 LM head rounded to bf16 after it runs as a
# separate 56 us convert kernel; now the product is asked for in bf16 (float32 accumulation).
# The LM head + argmax alone at 257 rows: float32 logits against the bf16 product, in turns; then
# DDTree(256) rounds at the new default with the kernel table (to see the LM head's kernel and
# that no convert of the logits is left).
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 120 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts in_out --layers 4 --calls 5 \
  --products lm_head+argmax:f32 lm_head+argmax:bf16-out lm_head+argmax:f32 lm_head+argmax:bf16-out \
  --out $OUT/lm_head_argmax.json > $OUT/lm_head_argmax.log 2>&1
grep -E "^\||rror" $OUT/lm_head_argmax.log | cut -c1-300
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/lm_head_argmax.json"))["rows"]:
    print(r["product"], r["us"], r["by_kernel_us"])
PY
timeout -s KILL 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 60 \
  --out $OUT/rounds_logits.json > $OUT/rounds_logits.log 2>&1
grep -E "^\| ddtree|rror|fail" $OUT/rounds_logits.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_logits.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["round_ms"], p.get("device_ms"), {k: round(v, 4) for k, v in (p.get("by_scope") or {}).items()},
          {k: round(v, 4) for k, v in (p.get("gap_by_scope") or {}).items()}, p.get("kernels_per_call"))
    for k in p.get("kernels") or []:
        if any(s in k[4] for s in ("accept", "...e,ev", "convert")) or "convert" in k[0]:
            print("   ", k[0][:48], round(k[1], 4), k[2], k[4][-50:])
PY
