#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md, one phase per run (each fits in 10 minutes).
#
#   bash dflash_jax/bench/gpu_runbook.sh PHASE[,PHASE...] [OUT_DIR]   (OUT_DIR defaults to $OUT)
#
# Several phases joined by commas run one after another. LIMIT=seconds caps each benchmark step
# of the ar / decode / rounds / rounds-split / hybrid / kernel / top-k / train-step / tp phases (default 560).
#
# Phases:
#   ar            AR decode vs the roofline: Qwen3-8B shape and SmolLM2, ctx 1K/8K, with profiles
#   decode        AR, DFlash and DDTree(256) as decoding runs them (the generation's own loop),
#                 Qwen3-8B shape, ctx 4K, timed in turns in one process; REST=seconds rests the GPU
#                 before each timed generation (below the power limit)
#   rounds        DFlash / DDTree round latency, 8 rounds per call, budgets 16-512
#   rounds-split  the rounds with XLA command buffers off, for the per-stage split of each round
#                 and its 40 costliest kernels
#   kernel        tree attention vs XLA masked attention at ctx 1K-32K, W 1-512, the kernels as
#                 dispatched (the Mosaic GPU kernel on Hopper), with profiled kernel times
#                 (KERNEL_CONTEXTS, KERNEL_WIDTHS, KERNEL_TILINGS; SWEEP_S=seconds adds a tiling sweep)
#   kernel-tests  the GPU-only parity tests of the kernels against their references
#   gdn-verify    the tree-GDN verify (gates, tree_verify, commit per GDN layer) and its chunk alone,
#                 Pallas kernel against XLA, Qwen3.6-27B GDN shape, W 16/64/257 (GDN_WIDTHS); GDN_TILINGS
#                 ("block,block_v,warps[,stages[,precision[,share]]]" ...) also times the chunk at each of
#                 those kernel tilings, one process and GDN_TILING_S seconds (120) each; the default
#                 tiling's run adds each chunk's kernel table (--profile)
#   lossless      greedy DDTree and DFlash against greedy AR on the GPU (float32)
#   top-k         the tree's vocabulary top-k alone, [15, 151936], k 16-512
#   kernel-sweep  only the random tiling sweep, SWEEP_S seconds (default 300), at SWEEP_WIDTHS
#                 (default "64 272") and SWEEP_CONTEXTS (default "4096 32768")
#   drafter       SmolLM2 drafter: make-data (4 samples per prompt), train with a 2% validation split,
#                 export the best-validation drafter (GGUF=path, DATA=dir, STEPS, TRAIN_S, GEN_S).
#                 TRAIN_DP=2 trains data-parallel over 2 GPUs (`train --dp`; the batch of 32 is split);
#                 LABELS=target or target-soft, INIT=drafter, SAMPLES=responses per prompt (4), LAYERS=drafter
#                 layers (3; with INIT it must match); calling it again resumes the run
#   drafter-ab    two drafters at once from one token file, GPU 0 --labels response, GPU 1 --labels
#                 target (AB_LABELS="a b" picks two others, e.g. "target target-soft"); calling it
#                 again resumes both (STEPS spans the runs, TRAIN_S each);
#                 INIT=drafter starts both from a trained drafter (`train --init`)
#   eval-ab       gsm8k tau (128 prompts) of both drafter-ab drafters at once, DFlash and DDTree(64)
#   eval-pick     after eval-ab: the one with the higher DFlash tau (OUT_DIR/winner.txt), then its
#                 eval with gsm8k on GPU 0 and spec_bench on GPU 1
#   eval          tau on gsm8k (128) + spec_bench (480) for DFlash and DDTree 16/64/256 (DRAFT=dir);
#                 eval-gsm8k and eval-spec-bench run one set each
#   drafter-mix   SmolLM2 drafter on the broad mix of dflash_jax/drafters/DATA.md: make-prompts (code
#                 tasks from the stdlib, seed topics, long-context tasks), make-data over code +
#                 alpaca_eval + gsm8k train (MIX_GSM8K prompts of it, 2000; SAMPLES responses per prompt,
#                 4) + the long-context tasks (rows of SEQ_LEN tokens, 1024) + the chat and translation
#                 prompts the target writes from seed_tasks.jsonl (decoded first, ~1 min), then train from
#                 INIT (default the shipped drafter) for STEPS (6000) within TRAIN_S (270) and export;
#                 ~3 min of generation + TRAIN_S + 1 min on an H200; calling it again resumes the run
#   eval-mix      one bench over gsm8k test (128) + spec_bench (480) + the held-out code set, tau by
#                 category, DFlash and DDTree(64): the drafter-mix drafter (DRAFT=dir) and the shipped
#                 one beside it (EVAL_MIX="mix shipped" picks), ~3 min each
#   speed         batch-1 tokens/s of AR, DFlash, DDTree beside the PyTorch reference (needs the
#                 gguf and dflash wheels on the path)
#   hybrid        the Qwen3.6-27B hybrid shape (random bf16 weights, 5-layer drafter, tp 1): the AR step,
#                 the DFlash round and DDTree(16/64/256) rounds at ctx 4K in one command, split by stage
#                 and the verify by attention and GDN layers (command buffers off), beside the GDN
#                 layers' share of the weight bytes. HYBRID_STEPS picks among "rounds ar prefill"
#                 (default "rounds"; ar: AR vs the roofline at ctx 1K/8K; prefill: 4K and 32K tokens),
#                 LIMIT seconds each
#   mtp-rounds    the Qwen3.6-27B hybrid shape (random bf16 weights) at ctx 4K, in one command: the AR
#                 step, the DFlash round, DDTree(64), MTP chains of 1-4 steps and an MTP tree (4 steps,
#                 16 nodes) of a random MTP head (draft + verify + commit); no per-stage split
#   mtp-train     SmolLM2 MTP head (`train --drafter-kind mtp`, its layer from the target's last) from the
#                 drafter phase's token file (RUN_DIR/tokens.npz, made if missing): the shipped drafter's
#                 schedule (STEPS 13500, batch 32, seq 512, LABELS target-soft) within TRAIN_S (330) s, 2%
#                 validation, the best exported to RUN_DIR/mtp/mtp (float32, ~17 MB), MTP_TRAIN_STEPS (1)
#                 chained steps learned; calling it again resumes
#   eval-mtp      one bench over gsm8k test (128) + spec_bench (480), greedy, batch 64: AR, MTP chains of
#                 MTP_STEPS (1 2 3 4) steps and an MTP tree (4 steps, MTP_BUDGET 16 nodes) of the mtp-train
#                 head (MTP=dir; the shipped one unless set), DFlash and DDTree(64) of the shipped drafter
#                 (DRAFT=dir); then the same methods at batch 1 on B1 (32) prompts of each set; ~8 min on
#                 an H200
#   train-step    drafter training-step tokens/s, 5-layer drafter against the Qwen3.6-27B shape (random
#                 bf16, tp=1, batch 4 x 2048): taps computed in the step vs streamed from a taps file;
#                 target GFLOP per step against bytes per token on disk (TS_BATCH, TS_SEQ override;
#                 TS_TP=2 splits the target over 2 GPUs as train --tp 2 does)
#   collectives   the all-reduce alone, by size and dtype: NCCL with XLA's CUDA graphs as they are, with
#                 the collectives recorded into them, and with graphs off
#   tp            tensor parallelism, tp=1 vs tp=2 (on a 2-GPU machine). TP_MODELS picks the shapes
#                 (default "qwen3-8b qwen3-32b"); TP_MEMORY=0 skips the peak-memory subprocess. One
#                 run per model fits the 10-minute limit: TP_MODELS=qwen3-8b TP_MEMORY=0, then
#                 TP_MODELS=qwen3-32b (which also measures the memory). TP_ALL_REDUCE="nccl one-shot"
#                 adds XLA's one-shot all-reduce kernel beside NCCL at tp=2 (also: nccl-sync, and
#                 one-shot-split: the kernel, with all-reduces over its 2 MB limit done in row chunks;
#                 nccl-graph: NCCL all-reduces recorded into XLA's CUDA graphs). TP_PROFILE=1 adds
#                 each round's kernel time per GPU by stage (command buffers off).
# `split PHASES0 PHASES1` runs two phase lists at once, on GPU 0 and GPU 1 of a 2-GPU machine.
# split, drafter-ab and eval-ab (so eval-pick too) stop with an error on a machine with one GPU.
# DRY=1 runs a phase on tiny shapes on the CPU: a check of this script, not a measurement.
# Each step has its own time limit and writes its log and JSON under OUT_DIR as it goes, so a
# step cut short still leaves what it measured; output is unbuffered (no filter in the pipe).
# BENCHMARKS.md names the phase behind each claim; its result files are copied from OUT_DIR to
# dflash_jax/bench/results/ under a name that says what they measure.
set -uo pipefail

need_two_gpus() {  # need_two_gpus PHASE HINT: one clear error instead of a CUDA failure on GPU 1
    [ "${DRY:-0}" = 1 ] && return 0
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "$n" -ge 2 ] && return 0
    echo "gpu_runbook.sh $1: needs 2 GPUs (one job per GPU), found $n; $2" >&2
    exit 2
}

phases=${1:?usage: gpu_runbook.sh PHASE[,PHASE...] [OUT_DIR]  or  gpu_runbook.sh split PHASES0 PHASES1 [OUT_DIR]}
if [ "$phases" = split ]; then
    # Two single-GPU phase lists at once, one per GPU of a 2-GPU machine; logs under OUT_DIR/gpu0
    # and OUT_DIR/gpu1 (made before either starts), packed at the end into OUT_DIR/gpu0.tgz and
    # OUT_DIR/gpu1.tgz. Neither process preallocates GPU memory.
    out=${4:-${OUT:-/tmp/runbook}}
    need_two_gpus split "run the phase lists one after another instead"
    mkdir -p "$out/gpu0" "$out/gpu1"
    CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false bash "$0" "${2:?PHASES0}" "$out/gpu0" \
        > "$out/gpu0/console.log" 2>&1 &
    first=$!
    CUDA_VISIBLE_DEVICES=1 XLA_PYTHON_CLIENT_PREALLOCATE=false bash "$0" "${3:?PHASES1}" "$out/gpu1" \
        > "$out/gpu1/console.log" 2>&1
    wait "$first"
    tail -n 40 "$out/gpu0/console.log" "$out/gpu1/console.log"
    # Each GPU's logs and JSON as one archive (fewer files to copy back from a remote machine);
    # the drafter's weight parts (15 MB each) stay as they are.
    for g in gpu0 gpu1; do
        tar czf "$out/$g.tgz" --exclude='drafter.safetensors.part_*' -C "$out" "$g"
        find "$out/$g" -type f ! -name 'drafter.safetensors.part_*' -delete
    done
    exit 0
fi
out=${2:-${OUT:-/tmp/runbook}}
if [[ $phases == *,* ]]; then
    for p in ${phases//,/ }; do bash "$0" "$p" "$out"; done
    exit 0
fi
phase=$phases
limit=${LIMIT:-560}
mkdir -p "$out"
# /tmp/site: where BUILD.md installs the carried wheels (gguf, dflash) on the device.
[ -d /tmp/site ] && PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off in every phase: a program that uses it can take the host's GPUs
# out of service. With it off NCCL creates no multicast object (nccl-symmetric included).
export NCCL_NVLS_ENABLE=0
dry=${DRY:-0}
data=${DATA:-.data}
gguf=${GGUF:-smollm2}
run_dir=${RUN_DIR:-/root/run}
read -r -a ab_labels <<< "${AB_LABELS:-response target}"  # drafter-ab / eval-ab / eval-pick: one per GPU
[ "$dry" = 1 ] && run_dir=$out/run

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name ($limit s): $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
}

kernel_sweep() {  # kernel_sweep SECONDS ARGS...: the random tiling sweep, 30 s of it left for start-up
    local seconds=$1; shift
    step kernel_sweep "$seconds" python -m dflash_jax.bench.tree_attention_bench --sweep "$@" \
        --sweep-budget "$(( seconds - 30 ))" --out "$out/kernel_sweep.json"
}
drafter_args() {  # make-data's and train's flags (gen, trn), and train_dp, of the drafter phases
    train_dp=${TRAIN_DP:-1}
    if [ "$dry" = 1 ]; then
        # Without a GPU the host CPU shows as TRAIN_DP devices, so the data-parallel path runs too
        # (the batch of 2 splits for TRAIN_DP 1 or 2).
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=$train_dp"
        gen=(--limit 4 --gen-tokens 16 --gen-batch 4 --samples-per-prompt 2)
        trn=(--steps 4 --batch 2 --seq-len 128 --blocks 4 --log-every 2 --val-fraction 0.25 --eval-every 2 --keep-best)
    else
        gen=(--gen-batch 512 --samples-per-prompt "${SAMPLES:-4}")
        trn=(--steps "${STEPS:-10000}" --batch 32 --log-every 50 --val-fraction 0.02 --keep-best)
    fi
}

make_tokens() {  # the token file RUN_DIR/tokens.npz, unless an earlier run made it (GPU 0 only)
    [ -f "$run_dir/tokens.npz" ] && return 0
    # 4 x 8.3K responses: ~70 s of generation (BENCHMARKS.md) plus loading and compiling.
    (export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
     step make_data "${GEN_S:-200}" python -m dflash_jax.cli make-data --target "$gguf" --data-dir "$data" \
         "${gen[@]}" --out "$run_dir/tokens.npz")
}

start_args() {  # start_args RUN: --resume if RUN holds a run, else --init INIT if INIT is set
    start=()
    if [ -f "$1/train_run.json" ]; then start=(--resume)
    elif [ -n "${INIT:-}" ]; then start=(--init "$INIT"); fi
}

train_drafter() {  # train_drafter STEP RUN LABELS [FLAGS...]: train (or resume) a drafter into RUN
    local name=$1 run=$2 labels=$3
    shift 3
    start_args "$run"
    step "$name" "$(( ${TRAIN_S:-330} + 60 ))" python -m dflash_jax.cli train --target "$gguf" \
        --data "${tokens:-$run_dir/tokens.npz}" --out "$run" --layers "${LAYERS:-3}" --time-limit "${TRAIN_S:-330}" \
        --labels "$labels" --export-dtype bfloat16 --no-progress "${start[@]}" "$@" "${trn[@]}"
}

mix_prompts() {  # the code prompt sets in RUN_DIR/prompts (make-prompts: a few seconds, no GPU)
    [ -f "$run_dir/prompts/prompt_sets.json" ] && return 0
    python -m dflash_jax.cli make-prompts --out "$run_dir/prompts" > "$out/prompt_sets.json"
}

eval_args() {  # the evaluation phases' prompt counts and limits
    if [ "$dry" = 1 ]; then n_gsm8k=2 lim=(--limit 2 --max-new-tokens 16) budgets=(16) ab=(--budget 16 --batch 2) fast=(--limit 2 --max-new-tokens 16)
    else n_gsm8k=128 lim=(--max-new-tokens 256) budgets=(16 64 256) ab=(--budget 64 --batch 64) fast=(--limit 10 --max-new-tokens 256); fi
}

spec_args() {  # the round benchmark's shapes
    if [ "$dry" = 1 ]; then echo --model tiny --ctx 64 --budgets 16 --ddtree-ctx 128
    else echo --ctx 512 4096 --budgets 16 64 256 512; fi
}

case $phase in
ar)
    if [ "$dry" = 1 ]; then set -- --models tiny --contexts 64 256 --steps 8 --copy-gb 0.05 --impls reference
    else set -- --models smollm2-135m qwen3-8b --contexts 1024 8192 --impls pallas; fi
    step ar "$limit" python -m dflash_jax.bench.ar_decode "$@" --profile --dump-hlo "$out/hlo" --out "$out/ar.json" ;;
decode)
    # 128 new tokens: random weights accept about one token a round, so 127 rounds a generation.
    if [ "$dry" = 1 ]; then set -- --model tiny --budget 4 --ctx 32 --new 4 --iters 1
    else set -- --budget 256 --ctx 4096 --new 128 --iters 5; fi
    step decode "$limit" python -m dflash_jax.bench.decode_loop "$@" --method ar dflash ddtree --rounds-per-check 1 \
        --rest "${REST:-0}" --out "$out/decode.json" ;;
rounds)
    # shellcheck disable=SC2046
    # Each round compiled as decoding compiles it.
    step rounds "$limit" python -m dflash_jax.bench.spec_round $(spec_args) --no-profile --out "$out/rounds.json" ;;
rounds-split)
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
    # shellcheck disable=SC2046
    step rounds_split "$limit" python -m dflash_jax.bench.spec_round $(spec_args) --kernel-table 40 \
        --dump-hlo "$out/hlo" --out "$out/rounds_split.json" ;;
kernel)
    # The grid (ctx 1K-32K, W 16-512, plus W 1 and 272): the Triton kernel, the kernels as
    # dispatched (`--hopper`: the Mosaic GPU kernel on sm_90 where it applies) and XLA, with GPU
    # kernel times from a profile.
    # KERNEL_CONTEXTS / KERNEL_WIDTHS narrow the grid; KERNEL_TILINGS adds explicit tilings
    # ("W:block_q,block_k,warps,stages,split[,tail]" ...), each timed beside the default.
    tilings=()
    for t in ${KERNEL_TILINGS:-}; do tilings+=(--tiling "$t"); done
    if [ "$dry" = 1 ]; then set -- --interpret
    else
        # shellcheck disable=SC2086
        set -- --contexts ${KERNEL_CONTEXTS:-1024 4096 16384 32768} --widths ${KERNEL_WIDTHS:-1 16 64 256 272 512} \
            --reps 5 --budget 480 --profile /tmp/kernel_profile
    fi
    step kernel "$limit" python -m dflash_jax.bench.tree_attention_bench "$@" --hopper "${tilings[@]}" \
        --out "$out/kernel.json"
    # SWEEP_S=seconds adds a random tiling sweep at W = 64 and 272 (ctx 4K and 32K).
    [ "$dry" = 1 ] || [ -z "${SWEEP_S:-}" ] || kernel_sweep "$SWEEP_S" --contexts 4096 32768 --widths 64 272 ;;
kernel-tests)
    # tests/conftest.py keeps jax on the CPU unless JAX_PLATFORMS says otherwise.
    if [ "$dry" = 1 ]; then echo "kernel-tests: GPU only (nothing to run with DRY=1)"
    # Every kernel's GPU case is named test_gpu_*: the files are found, not listed.
    else JAX_PLATFORMS=cuda step kernel_tests "$limit" python -m pytest -q tests -k gpu_; fi ;;
gdn-verify)
    if [ "$dry" = 1 ]; then set -- --model tiny-hybrid --widths 5 17 --interpret --warmup 1 --iters 2
                            tilings="16,16,4 16,16,4,1,ieee,share"
    else
        # shellcheck disable=SC2086
        set -- --model qwen3.6-27b --widths ${GDN_WIDTHS:-16 64 257}; tilings=${GDN_TILINGS:-}
    fi
    step gdn_verify "$limit" python -m dflash_jax.bench.gdn_verify_bench "$@" --profile --out "$out/gdn_verify.json"
    # Each tiling in its own process and time limit (GDN_TILING_S, default 120 s): a tiling whose
    # Triton compile runs for minutes (large float32 tiles) costs its own limit, not the rest.
    for t in $tilings; do
        step "gdn_verify_${t//,/-}" "${GDN_TILING_S:-120}" python -m dflash_jax.bench.gdn_verify_bench "$@" --tilings "$t" \
            --out "$out/gdn_verify_${t//,/-}.json"
    done ;;
lossless)
    if [ "$dry" = 1 ]; then echo "lossless: GPU only (make test runs the same tests on the CPU)"
    else JAX_PLATFORMS=cuda step lossless "$limit" python -m pytest -q tests/test_speculative.py \
        -k "greedy_speculative_equals or at_any_width"; fi ;;
top-k)
    if [ "$dry" = 1 ]; then set -- --budgets 16 --vocab 4096 --depth 3 --calls 2
    else set -- --budgets 16 64 256 512; fi
    step top_k "$limit" python -m dflash_jax.bench.top_k_bench "$@" --out "$out/top_k.json" ;;
kernel-sweep)
    # The sweep alone: `kernel SWEEP_S=...` first times the whole grid, which takes most of a
    # 10-minute run. Each configuration's median ms is printed as it finishes.
    if [ "$dry" = 1 ]; then kernel_sweep 120 --interpret --contexts 64 --widths 16
    else
        # shellcheck disable=SC2086
        kernel_sweep "${SWEEP_S:-300}" --contexts ${SWEEP_CONTEXTS:-4096 32768} --widths ${SWEEP_WIDTHS:-64 272}
    fi ;;
drafter)
    # 4 responses per prompt (the first greedy or T=1, the others T=1); 2% of the prompts held out,
    # validated every 10 log records, and the drafter exported from the best validation tau.
    # LABELS=target learns the target's greedy tokens (`train --labels`); INIT=drafter starts
    # from a trained drafter; calling the phase again resumes the run in RUN_DIR/run (the token
    # file is kept), so STEPS may span several runs of TRAIN_S seconds each. With the token
    # file made in the same run, TRAIN_S + 60 s + ~100 s stays under 10 minutes.
    drafter_args
    make_tokens || exit 1
    train_drafter train "$run_dir/run" "${LABELS:-response}" --dp "$train_dp" || exit 1
    # The transfer back takes files of at most 16 MiB: the weights come in parts.
    split -b 15M "$run_dir/run/drafter/model.safetensors" "$out/drafter.safetensors.part_"
    tar czf "$out/drafter_run.tgz" -C "$run_dir/run" train_run.json log.jsonl plots drafter/config.json ;;
drafter-ab)
    # Two drafters from the same responses at once, one per GPU: by default GPU 0 learns the
    # response tokens (--labels response), GPU 1 the target's own greedy tokens (--labels target),
    # in RUN_DIR/response and RUN_DIR/target; AB_LABELS="target target-soft" picks two other
    # `train --labels` values (the same for eval-ab and eval-pick). The token file is made once.
    # Running the phase again resumes both runs (while the machine keeps RUN_DIR), so STEPS may
    # span several runs of TRAIN_S seconds each. INIT=drafter (a directory
    # or "smollm2", the shipped one) starts both runs from that drafter's weights instead of
    # random ones (`train --init`).
    need_two_gpus drafter-ab "on one GPU run the drafter / eval phases with LABELS=... instead"
    drafter_args
    make_tokens || exit 1
    gpu=0
    for labels in "${ab_labels[@]}"; do
        (export CUDA_VISIBLE_DEVICES=$gpu XLA_PYTHON_CLIENT_PREALLOCATE=false
         train_drafter "train_$labels" "$run_dir/$labels" "$labels") &
        gpu=$((gpu + 1))
    done
    wait
    records=()
    for labels in "${ab_labels[@]}"; do
        split -b 15M "$run_dir/$labels/drafter/model.safetensors" "$out/$labels.safetensors.part_"
        records+=("$labels"/{train_run.json,log.jsonl,plots,drafter/config.json})
    done
    tar czf "$out/drafter_ab.tgz" -C "$run_dir" "${records[@]}" ;;
eval-ab)
    # gsm8k tau of drafter-ab's two drafters at once (GPU 0: the first of AB_LABELS, GPU 1: the
    # second), DFlash and DDTree(64): the one to ship, before the full eval / speed phases.
    need_two_gpus eval-ab "on one GPU run the drafter / eval phases with LABELS=... instead"
    eval_args
    gpu=0
    for labels in "${ab_labels[@]}"; do
        (export CUDA_VISIBLE_DEVICES=$gpu XLA_PYTHON_CLIENT_PREALLOCATE=false
         step "tau_$labels" 240 python -m dflash_jax.cli bench --target "$gguf" --draft "$run_dir/$labels/drafter" \
             --method dflash ddtree "${ab[@]}" --prompts "$data/gsm8k/test.jsonl" --no-progress \
             "${lim[@]}" --limit "$n_gsm8k" --out "$out/tau_$labels") &
        gpu=$((gpu + 1))
    done
    wait ;;
eval-pick)
    # After eval-ab: the drafter with the higher gsm8k DFlash tau (RUN_DIR/<labels>), named in
    # OUT_DIR/winner.txt, then its full eval split over the GPUs (gsm8k on GPU 0, spec_bench on
    # GPU 1; OUT_DIR/gpu0.tgz and gpu1.tgz).
    winner=$(python - "$out" "${ab_labels[@]}" <<'PY'
import json, sys
taus = {}
for labels in sys.argv[2:]:
    methods = json.load(open(f"{sys.argv[1]}/tau_{labels}/report.json"))["methods"]
    taus[labels] = next(m["tau"] for name, m in methods.items() if name.startswith("dflash"))
print(max(taus, key=taus.get), file=sys.stdout)
print(f"gsm8k DFlash tau: {taus}", file=sys.stderr)
PY
) || exit 1
    echo "$winner" > "$out/winner.txt"
    echo "== winner: $winner"
    DRAFT=$run_dir/$winner/drafter bash "$0" split eval-gsm8k eval-spec-bench "$out" ;;
drafter-mix)
    # The mix (dflash_jax/drafters/DATA.md): the stdlib tasks' training split, the seed-topic tasks,
    # alpaca_eval and MIX_GSM8K gsm8k train questions; the held-out code set, gsm8k test and
    # spec_bench are refused by make-data. The drafter starts from INIT (the shipped one unless
    # set) and learns the target's distribution (LABELS, default target-soft, as the shipped one).
    # The long-context tasks (context_tasks.jsonl, prompts of 300-1000 tokens) need longer prompts
    # in make-data and longer training rows.
    drafter_args
    mix_prompts || exit 1
    tokens=$run_dir/mix_tokens.npz
    long=() rows=()
    [ "$dry" = 1 ] || { long=(--max-prompt-tokens 768); rows=(--seq-len "${SEQ_LEN:-1024}"); }
    # The prompts the target writes itself: decode the seeds at T > 0, keep the usable answers.
    seeds=$run_dir/prompts/seed_tasks.jsonl answers=$run_dir/prompts/seed_answers.jsonl
    if [ ! -f "$run_dir/prompts/derived_tasks.jsonl" ]; then
        if [ "$dry" = 1 ]; then head -n 6 "$seeds" > "$run_dir/prompts/seeds_dry.jsonl"
            seeds=$run_dir/prompts/seeds_dry.jsonl seedgen=(--batch 3 --max-new-tokens 12)
        else seedgen=(--batch 256 --max-new-tokens 96); fi
        (export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
         step decode_seeds "${SEED_S:-200}" python -m dflash_jax.cli decode --model "$gguf" --input "$seeds" \
             --output "$answers" --temperature 0.8 --no-progress "${seedgen[@]}") || exit 1
        python -m dflash_jax.cli make-prompts --answers "$answers" --out "$run_dir/prompts" \
            > "$out/derived_tasks.json" || exit 1
    fi
    if [ ! -f "$tokens" ]; then
        (export CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
         step make_data_mix "${GEN_S:-300}" python -m dflash_jax.cli make-data --target "$gguf" --prompts \
             "$run_dir/prompts/code_stdlib_train.jsonl" "$run_dir/prompts/code_topics.jsonl" \
             "$data/alpaca_eval/instructions.jsonl" "$data/gsm8k/train.jsonl:${MIX_GSM8K:-2000}" \
             "$run_dir/prompts/context_tasks.jsonl" "$run_dir/prompts/derived_tasks.jsonl" "${gen[@]}" \
             "${long[@]}" --out "$tokens") || exit 1
    fi
    # drafter_args' flags with the mix's own step default (its first two entries are --steps N).
    [ "$dry" = 1 ] || trn=(--steps "${STEPS:-6000}" "${trn[@]:2}" "${rows[@]}")
    INIT=${INIT:-smollm2} TRAIN_S=${TRAIN_S:-270} train_drafter train_mix "$run_dir/mix" "${LABELS:-target-soft}" \
        --dp "$train_dp" || exit 1
    split -b 15M "$run_dir/mix/drafter/model.safetensors" "$out/mix_drafter.safetensors.part_"
    cp "$run_dir/prompts/prompt_sets.json" "$run_dir/mix/prompt_sets.json"
    tar czf "$out/mix_drafter_run.tgz" -C "$run_dir/mix" train_run.json log.jsonl plots drafter/config.json \
        prompt_sets.json ;;
eval-mix)
    # One command per drafter over all three held-out sets; tau by category in
    # OUT_DIR/tau_mix_<name>/tau_by_category.md and report.json.
    mix_prompts || exit 1
    if [ "$dry" = 1 ]; then sets=("$data/gsm8k/test.jsonl:2" "$data/spec_bench/question.jsonl:2" \
                                  "$run_dir/prompts/code_heldout.jsonl:2") mix=(--max-new-tokens 16 --batch 2)
    else sets=("$data/gsm8k/test.jsonl:128" "$data/spec_bench/question.jsonl" "$run_dir/prompts/code_heldout.jsonl")
         mix=(--max-new-tokens 256 --batch 64); fi
    for name in ${EVAL_MIX:-mix shipped}; do
        case $name in
        mix) draft=${DRAFT:-$run_dir/mix/drafter} ;;
        shipped) draft=smollm2 ;;
        *) echo "eval-mix: unknown EVAL_MIX entry $name (mix, shipped)" >&2; exit 2 ;;
        esac
        step "tau_mix_$name" 290 python -m dflash_jax.cli bench --target "$gguf" --draft "$draft" \
            --method dflash ddtree --budget 64 --prompts "${sets[@]}" --no-progress "${mix[@]}" \
            --out "$out/tau_mix_$name" || exit 1
    done ;;
eval | eval-gsm8k | eval-spec-bench | speed)
    draft=${DRAFT:-$run_dir/run/drafter}
    eval_args
    if [ "$phase" != speed ]; then
        # tau over whole prompt sets, batched (tau does not depend on the batch); eval = both sets
        [ "$phase" = eval-spec-bench ] || step tau_gsm8k 240 python -m dflash_jax.cli bench --target "$gguf" \
            --draft "$draft" --method dflash ddtree --budget "${budgets[@]}" --prompts "$data/gsm8k/test.jsonl" \
            --batch 64 --no-progress "${lim[@]}" --limit "$n_gsm8k" --out "$out/tau_gsm8k"
        [ "$phase" = eval-gsm8k ] || step tau_spec_bench 300 python -m dflash_jax.cli bench --target "$gguf" \
            --draft "$draft" --method dflash ddtree --budget "${budgets[@]}" \
            --prompts "$data/spec_bench/question.jsonl" --batch 64 --no-progress "${lim[@]}" \
            --out "$out/tau_spec_bench"
    else
        # speed: batch 1, ours then the PyTorch reference on the same prompts
        step speed_jax 240 python -m dflash_jax.cli bench --target "$gguf" --draft "$draft" \
            --method ar dflash ddtree --budget 64 --prompts "$data/gsm8k/test.jsonl" --batch 1 --no-progress \
            "${fast[@]}" --out "$out/speed_jax"
        ref_gguf=$gguf
        [ "$gguf" = smollm2 ] && ref_gguf=$(python -c "from convert.gguf_file import smollm2_gguf_path as p; print(p())")
        step speed_torch 300 python -m dflash_jax.bench.torch_reference --gguf "$ref_gguf" --draft "$draft" \
            --prompts "$data/gsm8k/test.jsonl" "${fast[@]}" --out "$out/speed_torch.json"
    fi ;;
tp)
    if [ "$dry" = 1 ]; then set -- --tiny; else set -- --models ${TP_MODELS:-qwen3-8b qwen3-32b}; fi
    [ "${TP_MEMORY:-1}" = 0 ] && set -- "$@" --no-memory
    # TP_PROFILE=1: each round's kernel time per GPU by stage, tp = 1 against tp = 2 (which stage
    # does not halve); command buffers off so that kernels map to their stage.
    if [ "${TP_PROFILE:-0}" = 1 ]; then
        set -- "$@" --profile /tmp/tp_profile
        export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
    fi
    tag=$(echo "${TP_MODELS:-all}" | tr ' ' '_')
    # TP_ALL_REDUCE="nccl one-shot": tp = 2 also with XLA's own all-reduce kernel for the small
    # all-reduces (NCCL costs ~20 us each however small: BENCHMARKS.md), in the same process.
    # TP_ALL_REDUCE="nccl nccl-overlap": also with each layer's post-attention work in two row
    # groups whose all-reduces may overlap the other group's products (`overlap_row_groups`).
    # TP_ALL_REDUCE="nccl nccl-symmetric nccl-user-buffers": NCCL on symmetric-memory windows
    # (its low-latency kernels) or on registered buffers; they need a collective memory arena,
    # which tensor_parallel sizes itself.
    # shellcheck disable=SC2086
    step "tp_$tag" "$limit" python -m dflash_jax.bench.tensor_parallel "$@" --all-reduce ${TP_ALL_REDUCE:-nccl} \
        --out "$out/tp_$tag.json" ;;
hybrid)
    if [ "$dry" = 1 ]; then
        ar=(--models tiny-hybrid --contexts 64 256 --steps 8 --copy-gb 0.05 --impls reference)
        rounds=(--model tiny-hybrid --ctx 64 --budgets 16 64 --ddtree-ctx 64)
        pre=(--model tiny-hybrid --prefill 64 256)
    else
        ar=(--models qwen3.6-27b --contexts 1024 8192)
        rounds=(--model qwen3.6-27b --ctx 4096 --budgets 16 64 256 --ddtree-ctx 4096)
        pre=(--model qwen3.6-27b --prefill 4096 32768)
    fi
    for part in ${HYBRID_STEPS:-rounds}; do
        case $part in
        ar) step hybrid_ar "$limit" python -m dflash_jax.bench.ar_decode "${ar[@]}" --profile \
                --out "$out/hybrid_ar.json" ;;
        # The DFlash round against the AR step and DDTree's at the same context, each split by
        # stage: command buffers off, as rounds-split, so that kernels map to their scopes.
        rounds) (export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer="
                 step hybrid_rounds "$limit" python -m dflash_jax.bench.spec_round "${rounds[@]}" \
                     --kernel-table 40 --out "$out/hybrid_rounds.json") ;;
        # No rounds: the prefill alone (a length that does not fit is reported, not fatal).
        prefill) step hybrid_prefill "$limit" python -m dflash_jax.bench.spec_round "${pre[@]}" --ctx --budgets \
                     --no-profile --out "$out/hybrid_prefill.json" ;;
        *) echo "hybrid: unknown HYBRID_STEPS entry $part (ar, rounds, prefill)" >&2; exit 2 ;;
        esac
    done ;;
mtp-rounds)
    if [ "$dry" = 1 ]; then
        set -- --model tiny-hybrid --ctx 32 --budgets 4 --ddtree-ctx 32 --mtp-steps 1 2 --mtp-budgets 4
    else
        set -- --model qwen3.6-27b --ctx 4096 --budgets 64 --ddtree-ctx 4096 --mtp-steps 1 2 3 4 --mtp-budgets 16
    fi
    step mtp_rounds "$limit" python -m dflash_jax.bench.spec_round "$@" --no-profile --out "$out/mtp_rounds.json" ;;
mtp-train)
    # The token file and schedule of the shipped DFlash drafter (its train_run.json): an MTP head
    # trained on the same data, labels and steps, for TRAIN_S seconds of GPU time.
    drafter_args
    make_tokens || exit 1
    if [ "$dry" = 1 ]; then set -- --steps 4 --batch 2 --seq-len 128 --log-every 2 --val-fraction 0.25 --eval-every 2
    else set -- --steps "${STEPS:-13500}" --batch 32 --seq-len 512 --log-every 50 --val-fraction 0.02; fi
    mtp_run=$run_dir/mtp
    start=()
    if [ -f "$mtp_run/train_run.json" ]; then start=(--resume)
    else start=(--mtp-train-steps "${MTP_TRAIN_STEPS:-1}"); fi  # chained steps learned (a fresh run's)
    step mtp_train "$(( ${TRAIN_S:-330} + 60 ))" python -m dflash_jax.cli train --drafter-kind mtp --target "$gguf" \
        --data "$run_dir/tokens.npz" --out "$mtp_run" --time-limit "${TRAIN_S:-330}" --labels "${LABELS:-target-soft}" \
        --keep-best --no-progress "${start[@]}" "$@" || exit 1
    # The transfer back takes files of at most 16 MiB: the weights come in parts.
    split -b 15M "$mtp_run/mtp/mtp.safetensors" "$out/mtp.safetensors.part_"
    tar czf "$out/mtp_run.tgz" -C "$mtp_run" train_run.json log.jsonl plots ;;
eval-mtp)
    # One command: every method on the same prompts in one report (tau, tokens/s, speedup over AR).
    if [ "$dry" = 1 ]; then sets=("$data/gsm8k/test.jsonl:2" "$data/spec_bench/question.jsonl:2")
                            ev=(--max-new-tokens 16 --batch 2 --budget 16) mtp_steps=(1 2) mtp_budget=(8)
    else sets=("$data/gsm8k/test.jsonl:128" "$data/spec_bench/question.jsonl")
         ev=(--max-new-tokens 256 --batch 64 --budget 64)
         read -r -a mtp_steps <<< "${MTP_STEPS:-1 2 3 4}"
         mtp_budget=("${MTP_BUDGET:-16}"); fi
    step eval_mtp "$limit" python -m dflash_jax.cli bench --target "$gguf" --draft "${DRAFT:-smollm2}" \
        --mtp-head "${MTP:-smollm2}" --method ar mtp dflash ddtree --mtp-steps "${mtp_steps[@]}" \
        --mtp-budget "${mtp_budget[@]}" --prompts "${sets[@]}" --no-progress "${ev[@]}" --out "$out/eval_mtp" || exit 1
    # Batch 1, as a user decodes (B1 prompts of each set, 0 skips it): tokens/s where the verify is
    # bound by reading the weights, not by the batch's compute.
    b1=${B1:-32}
    [ "$dry" = 1 ] && b1=1
    [ "$b1" = 0 ] || step eval_mtp_b1 "$limit" python -m dflash_jax.cli bench --target "$gguf" \
        --draft "${DRAFT:-smollm2}" --mtp-head "${MTP:-smollm2}" --method ar mtp dflash ddtree \
        --mtp-steps "${mtp_steps[@]}" --mtp-budget "${mtp_budget[@]}" --no-progress \
        --prompts "${sets[0]%%:*}:$b1" "${sets[1]%%:*}:$b1" "${ev[@]}" --batch 1 --out "$out/eval_mtp_b1" ;;
train-step)
    if [ "$dry" = 1 ]; then set -- --model tiny-hybrid --layers 2 --batch 2 --seq-len 64 --blocks 4 --block-size 4 --batches 2 --iters 2
    else set -- --model qwen3.6-27b --layers 5 --batch "${TS_BATCH:-4}" --seq-len "${TS_SEQ:-2048}" --blocks 32 --iters 10; fi
    step train_step "$limit" python -m dflash_jax.bench.train_step "$@" --tp "${TS_TP:-1}" --taps-dir "$out/taps" \
        --out "$out/train_step.json"
    rm -rf "$out/taps" ;;
collectives)
    # One all-reduce at the tp shapes: NCCL, NCCL on the compute stream, XLA's one-shot kernel
    # 136 rows: half of a budget-256 tree, the chunk one-shot-split all-reduces at the 32B width.
    if [ "$dry" = 1 ]; then set -- --tiny; else set -- --rows 1 80 136 272 --hidden 4096 5120; fi
    # (nccl-sync and one-shot were no faster than nccl.) nccl-graph records the all-reduces into
    # XLA's CUDA graphs: is the ~19 us floor per op launch cost?
    step collectives "$limit" python -m dflash_jax.bench.collectives "$@" --variants nccl nccl-graph nccl-no-graph \
        --out "$out/collectives.json" ;;
*)
    echo "unknown phase: $phase (ar, decode, rounds, rounds-split, kernel, kernel-tests, gdn-verify, lossless, top-k," \
        "kernel-sweep, hybrid, mtp-rounds, drafter, drafter-ab, eval-ab, eval-pick, eval, eval-gsm8k, eval-spec-bench," \
        "speed, drafter-mix, eval-mix, mtp-train, eval-mtp, train-step, collectives, tp)" >&2
    exit 2 ;;
esac
