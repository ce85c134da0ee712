#!/bin/bash
# Twenty-seventh session, call 7: spec_round --clocks on the GPU (bench/clocks.py: the SM clock,
# power and throttle reasons sampled while each row is timed), with the final code's default
# DDTree(256) round, 8 rounds a call, in turns.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
timeout -s KILL 300 python -m dflash_jax.bench.spec_round --ctx --budgets 256 --no-profile --clocks --interleave 4 \
  --out $OUT/rounds_clocks.json > $OUT/rounds_clocks.log 2>&1
grep -E "^\| ddtree|^interleaved|rror|fail" $OUT/rounds_clocks.log | cut -c1-300
python -c "import json,os; d=json.load(open(os.environ['OUT']+'/rounds_clocks.json')); [print(r['round_ms'], r.get('round_ms_interleaved'), r.get('clocks')) for r in d['rows']]"
