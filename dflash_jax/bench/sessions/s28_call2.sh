#!/bin/bash
# Twenty-eighth session, call 2 (the session's last device minutes): the drafter's block-qkv
# layout (one qkv product and the qkv epilogue kernel in each drafter layer's block pass)
# checked on the GPU, then timed in whole DDTree(256) rounds beside today's fused layout, in
# turns, with the per-stage profile; then the folded Hopper kernel with the compute warpgroups
# at 232 / 216 registers against the default 224.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
JAX_PLATFORMS=cuda timeout -s KILL 150 python -m pytest -q -p no:warnings tests/test_drafter_block_qkv.py -k gpu \
  > $OUT/gpu_tests_block_qkv.log 2>&1
tail -3 $OUT/gpu_tests_block_qkv.log
timeout -s KILL 270 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --draft-layout fused block-qkv \
  --interleave 4 --out $OUT/rounds_block_qkv.json > $OUT/rounds_block_qkv.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_block_qkv.log | cut -c1-300
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/rounds_block_qkv.json"))
for r in d["rows"]:
    p = r.get("profile") or {}
    print(r.get("draft_layout"), r["round_ms"], r.get("round_ms_interleaved"), p.get("device_ms"), p.get("gap_ms"),
          {k: round(v, 4) for k, v in (p.get("by_scope") or {}).items()}, p.get("kernels_per_call"))
PY
timeout -s KILL 110 python -m dflash_jax.bench.tree_attention_bench --hopper --contexts 4096 --widths 257 \
  --profile /tmp/prof --hopper-sched r232:fold_tail=true,compute_registers=232 \
  --hopper-sched r216:fold_tail=true,compute_registers=216 --iters 40 --reps 7 --budget 100 \
  --out $OUT/hopper_registers.json > $OUT/hopper_registers.log 2>&1
grep -E "hopper|ctx=|rror" $OUT/hopper_registers.log | cut -c1-300
