#!/bin/bash
# Twenty-ninth session, call 3: the greedy argmax in two reductions (sampling.greedy_tokens: per
# chunk of the vocabulary, then over the chunks) against jnp.argmax, after the bf16 LM head, alone
# at 257 rows, in turns; then DDTree(256) rounds with it (now the default) and the kernel table.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
JAX_PLATFORMS=cuda timeout -s KILL 60 python -m pytest -q -p no:warnings tests/test_greedy_tokens.py \
  > $OUT/gpu_tests_greedy.log 2>&1
tail -1 $OUT/gpu_tests_greedy.log
timeout -s KILL 120 python -m dflash_jax.bench.gemm_shapes --rows 257 --layouts in_out --layers 4 --calls 5 \
  --products lm_head+argmax:bf16-out lm_head+argmax:bf16-out-chunked lm_head+argmax:bf16-out \
  lm_head+argmax:bf16-out-chunked --out $OUT/argmax.json > $OUT/argmax.log 2>&1
grep -E "rror" $OUT/argmax.log | cut -c1-300
python - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/argmax.json"))["rows"]:
    print(r["product"], r["us"], r["by_kernel_us"])
PY
timeout -s KILL 200 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 60 \
  --out $OUT/rounds_argmax.json > $OUT/rounds_argmax.log 2>&1
grep -E "^\| ddtree|rror|fail" $OUT/rounds_argmax.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_argmax.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r["round_ms"], p.get("device_ms"), {k: round(v, 4) for k, v in (p.get("by_scope") or {}).items()},
          {k: round(v, 4) for k, v in (p.get("gap_by_scope") or {}).items()}, p.get("kernels_per_call"))
    for k in p.get("kernels") or []:
        if "accept" in k[4] or "...e,ev" in k[4] or "propose" in k[4]:
            print("   ", k[0][:48], round(k[1], 4), k[2], k[4][-50:])
PY
