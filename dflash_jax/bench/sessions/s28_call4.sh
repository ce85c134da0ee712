#!/bin/bash
# Twenty-eighth session, call 4 (the last device minutes): the drafter's context rows through one
# kv_epilogue launch a drafter layer, checked against XLA's path on the GPU, then DDTree(256)
# rounds with it (auto) beside XLA's kernels (xla), with the per-stage profile, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 60 python -m pytest -q -p no:warnings tests/test_drafter_block_qkv.py -k gpu_context \
  > $OUT/gpu_tests_context.log 2>&1
tail -2 $OUT/gpu_tests_context.log
timeout -s KILL 150 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --context-epilogue auto xla \
  --interleave 4 --out $OUT/rounds_context.json > $OUT/rounds_context.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_context.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_context.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r.get("context_epilogue"), r["round_ms"], r.get("round_ms_interleaved"), p.get("device_ms"),
          {k: round(v, 4) for k, v in (p.get("by_scope") or {}).items()},
          {k: round(v, 4) for k, v in (p.get("gap_by_scope") or {}).items()}, p.get("kernels_per_call"))
PY
