#!/bin/bash
# Twenty-sixth session, call 5: every GPU test of the kernels (the test_gpu_* cases and the
# smaller-GPU tiling tests of tree_attention, qkv_epilogue, kv_compact, residual_norm, split_merge,
# the Hopper kernel and the gated-activation kernel) at today's code, in four processes.
export PYTHONPATH=. NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
FILES="tests/test_tree_attention_hopper.py tests/test_tree_attention.py tests/test_qkv_epilogue.py tests/test_kv_compact.py tests/test_residual_norm.py tests/test_split_merge.py tests/test_gate_up_silu.py"
JAX_PLATFORMS=cuda python -m pytest --collect-only -q -p no:warnings $FILES -k gpu 2>/dev/null | grep "::" > /tmp/ids
wc -l < /tmp/ids
for n in 0 1 2 3; do awk -v n=$n 'NR % 4 == n' /tmp/ids > /tmp/ids$n; done
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.2
for n in 0 1 2 3; do
  (JAX_PLATFORMS=cuda timeout -s KILL 430 python -m pytest -v -p no:warnings $(cat /tmp/ids$n) 2>&1 \
     | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " > $OUT/gpu_tests_all_$n.log) &
done
wait
cat $OUT/gpu_tests_all_*.log | grep -cE "PASSED"
cat $OUT/gpu_tests_all_*.log | grep -E "passed|failed|FAILED|ERROR" | head -20
