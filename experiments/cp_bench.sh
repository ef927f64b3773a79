#!/usr/bin/env bash
# Context parallelism on a 2-GPU machine, torchtitan 125M (titan_configs/nsa_125m_cp.toml:
# bf16, compile, full activation checkpointing, local batch 1, the local FineWeb sample): tokens/s
# per GPU and peak memory of
#   nsa_cp1_SEQ   NSA on one GPU (32k, 64k: the two runs side by side, one per GPU),
#   nsa_cp2_SEQ   NSA, one sequence over both GPUs, 32k .. 512k (a length that fails ends the
#                 climb: the longest that fits is the last ok row),
#   full_cp2_SEQ  the full-attention baseline over both GPUs: torchtitan's llama3 125M with its
#                 own context parallelism (SDPA ring attention, zig-zag shards), nsa_flex's data and
#                 tokenizer (--model.name nsa_flex_llama3, nsa_flex/titan/llama3_baseline.py; the same
#                 TOML, its [nsa] rope_theta included).
# Each run: STEPS steps logged every step, the first WARMUP (compile) left out; a run that fails
# (OOM, timeout) is recorded as such and the sweep goes on. The runs' logs go to LOGS (default
# /tmp/cp_bench_logs); after every run OUT gets three files (a device call returns 8 at most):
# cp.csv and cp.png (experiments/cp_report.py over every log in LOGS) and logs_PLAN.tgz, so a
# cut-off sweep keeps its table. Plans run in separate calls: untar their logs_*.tgz into one
# folder and run `python experiments/cp_report.py FOLDER` for the combined table and plot. A run's first step compiles for ~2 minutes (measured at 32k on 2 H100s), so the
# sweep is three plans of under 8 minutes each, one device call each:
#   scaling  nsa_cp1 32k and 64k side by side, then nsa_cp2 at 32k and 64k
#   long     nsa_cp2 at 128k, 256k, 512k (until one fails)
#   full     full_cp2 at 64k and 128k
# Usage (device machine, repo root; carry .whl with the torchtitan wheels and .data with
# tiktoken_cache and fineweb_sample_2800.parquet; torchtitan importable):
#   bash experiments/cp_bench.sh OUT [PLAN] [BUDGET_S]     # PLAN: scaling (default) | long | full
# then copy OUT/cp.csv and OUT/cp.png to experiments/results/perf/. ONLY="NAME ...": only those
# runs (e.g. ONLY=nsa_cp2_131072 to redo one); GPUS="2 3": the two GPUs to use (default "0 1");
# STEPS, WARMUP, CAP (s per run) as below.
set -uo pipefail
OUT=${1:?out dir}; PLAN=${2:-scaling}; BUDGET=${3:-460}
STEPS=${STEPS:-12}; WARMUP=${WARMUP:-4}; CAP=${CAP:-200}; LOGS=${LOGS:-/tmp/cp_bench_logs}
mkdir -p "$OUT" "$LOGS"
export TIKTOKEN_CACHE_DIR=$PWD/.data/tiktoken_cache PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
CFG=titan_configs/nsa_125m_cp.toml
rope() { python -c "from nsa_flex.rope import min_rope_base; print(f'{min_rope_base($1) * 1.05:.4g}')"; }

# run NAME GPUS CP SEQ [flags...]: one torchrun of CFG; its log LOGS/NAME.log, exit code LOGS/NAME.rc
run() {
  local name=$1 gpus=$2 cp=$3 seq=$4; shift 4
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return 0
  local n=$(( $(tr -cd , <<<"$gpus" | wc -c) + 1 )) left=$((BUDGET - SECONDS)) cap=$CAP
  [ "$left" -lt 40 ] && { echo "skipped (budget)" > "$LOGS/$name.rc"; echo "== skip $name (budget)"; return 1; }
  [ "$cap" -gt "$left" ] && cap=$left
  local dump ids gl g phys=(); dump=$(mktemp -d /tmp/cp_bench.XXXXXX)
  read -ra ids <<< "${GPUS:-0 1}"; IFS=, read -ra gl <<< "$gpus"  # logical 0/1 -> GPUS
  for g in "${gl[@]}"; do phys+=("${ids[$g]}"); done; gpus=$(IFS=,; echo "${phys[*]}")
  echo "== $name (gpus $gpus, cap ${cap}s, t=${SECONDS}s)"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$cap" torchrun --nproc_per_node="$n" \
    --master_port=$((29500 + RANDOM % 1000)) -m nsa_flex.titan.train --job.config_file $CFG \
    --training.seq_len "$seq" --parallelism.context_parallel_degree "$cp" \
    --training.dataset_path .data/fineweb_sample_2800.parquet --nsa.rope_theta "$(rope "$seq")" \
    --training.steps "$STEPS" --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 \
    --checkpoint.no-enable --metrics.no-enable_tensorboard --job.dump_folder "$dump" "$@" \
    > "$LOGS/$name.log" 2>&1
  local rc=$?; echo "$rc" > "$LOGS/$name.rc"; rm -rf "$dump"
  echo "   rc=$rc t=${SECONDS}s"; grep -a "step:" "$LOGS/$name.log" | tail -1 | cut -c1-200
  return $rc
}
report() {
  python experiments/cp_report.py "$LOGS" --warmup "$WARMUP"
  cp "$LOGS"/cp.csv "$OUT"/ 2>/dev/null; cp "$LOGS"/cp.png "$OUT"/ 2>/dev/null
  tar czf "$OUT/logs_$PLAN.tgz" -C "$LOGS" --exclude cp.csv --exclude cp.png .
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $PLAN in
  scaling)  # one GPU each, side by side (where one GPU fits the length), then both on one sequence
    run nsa_cp1_32768 0 1 32768 & run nsa_cp1_65536 1 1 65536; wait; report
    for seq in 32768 65536; do run nsa_cp2_$seq 0,1 2 $seq; report; done ;;
  long)  # NSA over 2 GPUs, climbing until a length fails; fewer steps (a 512k step takes seconds;
    # a run the budget cuts is recorded: redo it alone with ONLY=nsa_cp2_524288)
    # a run may take the whole budget: 128k's first step (compile) took more than 200 s on 2 H100s
    STEPS=${STEPS_LONG:-8}; CAP=${CAP_LONG:-$BUDGET}
    for seq in 131072 262144 524288; do
      run nsa_cp2_$seq 0,1 2 $seq; rc=$?; report
      [ $rc -ne 0 ] && break
    done ;;
  full)  # the llama3 baseline over 2 GPUs (torchtitan's ring attention)
    for seq in 65536 131072; do run full_cp2_$seq 0,1 2 $seq --model.name nsa_flex_llama3; report; done ;;
  *) echo "PLAN=$PLAN: allowed scaling, long, full"; exit 2 ;;
esac
echo "done $PLAN t=${SECONDS}s"
