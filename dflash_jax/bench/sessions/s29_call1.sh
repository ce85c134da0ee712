#!/bin/bash
# Twenty-ninth session, call 1: the verify's LM head and greedy argmax with float32 logits against
# logits rounded to bf16 first (model.logits_from_hidden's new convention, as transformers' bf16
# lm_head), alone at 257 rows; then DDTree(256) rounds at today's defaults beside XLA's GEMM
# autotuning off (xla_gpu_autotune_level=0: cuBLAS's first heuristic, to see whether the Memset
# before gate_up and the qkv tiling change), with the per-stage profile, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
timeout -s KILL 120 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts in_out --layers 4 --calls 5 \
  --products lm_head+argmax:f32 lm_head+argmax:bf16 lm_head+argmax:f32 lm_head+argmax:bf16 \
  --out $OUT/lm_head_argmax.json > $OUT/lm_head_argmax.log 2>&1
grep -E "^\||rror" $OUT/lm_head_argmax.log | cut -c1-300
timeout -s KILL 240 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --xla-options "" xla_gpu_autotune_level=0 \
  --kernel-table 14 --interleave 4 --out $OUT/rounds_autotune.json > $OUT/rounds_autotune.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_autotune.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_autotune.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(repr(r.get("xla_options")), r["round_ms"], r.get("round_ms_interleaved"), p.get("device_ms"),
          {k: round(v, 4) for k, v in (p.get("by_scope") or {}).items()},
          {k: round(v, 4) for k, v in (p.get("gap_by_scope") or {}).items()}, p.get("kernels_per_call"))
    for k in (p.get("kernels") or [])[:14]:
        print("   ", k[0][:48], round(k[1], 4), k[2], k[4][-40:])
PY
