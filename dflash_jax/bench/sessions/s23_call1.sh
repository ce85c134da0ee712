#!/bin/bash
# Twenty-third session, call 1: XLA's own (Triton) GEMMs for the verify instead of cuBLAS.
# cuBLAS kernels are launched without programmatic dependent launch (about 1.6-1.9 us idle before
# each of a layer's four GEMMs and gate_up's Memset) and fuse no epilogue; XLA's Triton GEMM
# fusions are its own kernels. One process per variant: XLA's autotune results are cached per
# process, so a variant run after another could reuse that one's picks.
#  A: XLA as it is (cuBLAS where its autotuner finds it faster)
#  B: no cuBLAS fallback (every GEMM fusion through Triton)
#  C: B with Triton's TMA loads and warp specialisation
#  D: C's Triton options with the cuBLAS fallback allowed
#  A again last, for drift.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
XLA_FLAGS=--help timeout 60 python -c "import jax; jax.numpy.zeros(1)" > $OUT/xla_help.txt 2>&1
grep -A2 -E "cublas_fallback|enable_triton_tma|triton_warp_specialization" $OUT/xla_help.txt | head -20
TMA=xla_gpu_experimental_enable_triton_tma=true,xla_gpu_experimental_enable_triton_warp_specialization=true
i=0
for xo in "" "xla_gpu_cublas_fallback=false" "xla_gpu_cublas_fallback=false,$TMA" "$TMA" ""; do
  i=$((i+1))
  if [ $SECONDS -gt 440 ]; then echo "=== variant $i skipped: $SECONDS s used"; continue; fi
  echo "=== variant $i: '$xo'"
  timeout ${T:-135} python -m dflash_jax.bench.spec_round --ctx --budgets 256 --kernel-table 40 \
    --xla-options "$xo" --out $OUT/rounds_triton_gemm_$i.json > $OUT/raw_$i.txt 2>&1
  grep -E "^\||^gaps|rror|fail|compile" $OUT/raw_$i.txt | grep -v "^|---" | tail -6
  python - $OUT/rounds_triton_gemm_$i.json <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception as e:
    print("no result", e); sys.exit()
for r in rows:
    p = r.get("profile") or {}
    print("round", round(r["round_ms"], 3), "device", round(p.get("device_ms", 0), 3), "gap", round(p.get("gap_ms", 0), 3),
          "compile_s", round(r.get("compile_s", 0), 1), "kernels", p.get("kernels_per_call"))
    for k in (p.get("kernels") or [])[:14]:
        print("  ", k)
PY
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
