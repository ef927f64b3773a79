#!/usr/bin/env bash
# Ablation: titan_configs/ablation.toml with six [nsa] masks presets (--nsa.masks: nsa,
# full_causal, sliding_only, random_selection, local_selection, no_compressed) trained on one GPU
# (flavor 30M_kv4, byte tokenizer, FineWeb sample + 90% passkey documents, seq 1024, bf16,
# torch.compile, the same STEPS x 16 x 1024 tokens each), then experiments/needle_eval.py on each
# final checkpoint at 1x, 2x and 4x the trained length (SEQ, default 1024: keep it equal to the
# TOML's seq_len), then one table (loss, tokens/s, accuracy per length) and a plot.
#
# Usage (device machine, repo root):
#   bash experiments/ablation_runs.sh OUT DATA STEPS [EXPORT]
#     OUT     work folder; everything is written there as it goes: OUT/<run>/{train.log, metrics.jsonl,
#             tb/, train_seconds, status, eval.log, needle/{needle.csv, summary.csv, needle_heatmap.png,
#             meta.json}}, OUT/ablation.csv, OUT/ablation.png, OUT/timeline.txt
#     DATA    folder with fineweb_sample_2800.parquet and tiktoken_cache/ (e.g. ../shared/data, or a
#             carried copy)
#     STEPS   training steps of every run
#     EXPORT  optional folder (e.g. $OUT of the device tool: at most 8 files come back) that gets,
#             refreshed after every run: ablation.csv, ablation.png, timeline.txt, ablation_runs.tgz
#             (all of OUT but the checkpoints)
#   e.g.  bash experiments/ablation_runs.sh /tmp/abl .data 6000 "$OUT"   (run 5, README "Results")
#
# Time: built for ONE device call (<= 9 min on an H100): the runs train CONCURRENTLY (JOBS=6 at once:
# the compiles overlap on the 16 CPU cores, the small models share the GPU), so tokens/s in the table
# are under contention -- compare speed with JOBS=1 runs. Compile is ~1.5-2.5 min per run when alone.
# Every stage gets a timeout from a global budget (BUDGET=520 s): training must end by
# BUDGET - EVAL_RESERVE (a killed run keeps its last checkpoint: one is saved every CKPT_EVERY steps,
# default STEPS/2); the evaluations run one at a time (GPU memory) as the runs finish, each cut at the
# budget (its CSV holds every row scored so far), with the dense reference attention (no compile; 8k
# needs ~17 GB for one prompt; a batch that runs out of memory is halved and retried). A failed run or eval is recorded in OUT/<run>/status
# and the others go on. Checkpoints (~120 MB each) go to RUNS_DIR (default /tmp/nsa_ablation_runs), off
# OUT. Timings per stage are printed and kept in OUT/timeline.txt.
#
# Runs: PRESETS lists them, each a masks preset name (--nsa.masks; the run is named after it) or NAME=PRESET:FLAG,FLAG,... -- a diagnostic variant of a preset with extra torchtitan
# flags, given to its training and (as --override) to its evaluation, e.g.
#   PRESETS="nsa_n16=nsa:--nsa.n_sel=16 nsa_mlp=nsa:--nsa.phi=mlp"
# Knobs (environment): BUDGET, EVAL_RESERVE (150), JOBS (6), PRESETS (the six), SEQ, LENGTHS (1x,2x,4x of
# SEQ), DEPTHS (0,10,..,100), TRIALS (1), KINDS (passkey,multikey), FILLER (synthetic: the training
# passkey documents' filler, i.e. in distribution; fineweb for real-text haystacks), CKPT_EVERY,
# RUNS_DIR, TRAIN_ARGS / EVAL_ARGS (extra flags, the same for every run; e.g. TRAIN_ARGS="--nsa.scorer torch"
# and EVAL_ARGS="--override=--nsa.scorer=torch --decode-backend torch" pin the torch reference paths
# instead of the fused Triton scorer / decode kernels), PYTHON (python).
set -uo pipefail
OUT=${1:?usage: ablation_runs.sh OUT DATA STEPS [EXPORT]}
DATA=${2:?usage: ablation_runs.sh OUT DATA STEPS [EXPORT]}
STEPS=${3:?usage: ablation_runs.sh OUT DATA STEPS [EXPORT]}
EXPORT=${4:-}
case "$STEPS" in ''|*[!0-9]*|0) echo "STEPS must be a positive integer, got '$STEPS'" >&2; exit 2;; esac
BUDGET=${BUDGET:-520}
EVAL_RESERVE=${EVAL_RESERVE:-150}
JOBS=${JOBS:-6}
PRESETS=${PRESETS:-"nsa full_causal sliding_only random_selection local_selection no_compressed"}
SEQ=${SEQ:-1024}
LENGTHS=${LENGTHS:-$SEQ,$((2 * SEQ)),$((4 * SEQ))}
DEPTHS=${DEPTHS:-0,10,20,30,40,50,60,70,80,90,100}
TRIALS=${TRIALS:-1}
KINDS=${KINDS:-passkey,multikey}
FILLER=${FILLER:-synthetic}
CKPT_EVERY=${CKPT_EVERY:-$(( STEPS / 2 > 10 ? STEPS / 2 : 10 ))}
RUNS_DIR=${RUNS_DIR:-/tmp/nsa_ablation_runs}
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}
PY=${PYTHON:-python}

[ -f "$DATA/fineweb_sample_2800.parquet" ] || { echo "DATA=$DATA has no fineweb_sample_2800.parquet" >&2; exit 2; }
[ -d "$DATA/tiktoken_cache" ] || { echo "DATA=$DATA has no tiktoken_cache/" >&2; exit 2; }
parse_run() {  # spec -> RUN_NAME RUN_PRESET RUN_FLAGS (space separated)
  local spec=$1 rest
  if [[ "$spec" == *=* ]]; then RUN_NAME=${spec%%=*}; rest=${spec#*=}; else RUN_NAME=$spec; rest=$spec; fi
  RUN_PRESET=${rest%%:*}
  RUN_FLAGS=""
  [[ "$rest" == *:* ]] && RUN_FLAGS=${rest#*:} && RUN_FLAGS=${RUN_FLAGS//,/ }
  return 0
}
for spec in $PRESETS; do
  parse_run "$spec"
  [[ "$RUN_NAME" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "PRESETS entry '$spec': run name '$RUN_NAME' must be [A-Za-z0-9_.-]+" >&2; exit 2; }
  $PY -c 'import sys, masks; sys.exit(sys.argv[1] not in masks.PRESETS)' "$RUN_PRESET" 2>/dev/null \
    || { echo "PRESETS entry '$spec': '$RUN_PRESET' is not a masks preset" >&2; exit 2; }
  for f in $RUN_FLAGS; do
    [[ "$f" == --*=* ]] || { echo "PRESETS entry '$spec': flag '$f' must look like --section.field=value" >&2; exit 2; }
  done
done
DATA=$(cd "$DATA" && pwd)
mkdir -p "$OUT" "$RUNS_DIR" ${EXPORT:+"$EXPORT"}
OUT=$(cd "$OUT" && pwd)
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken_cache PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
note() { echo "[$(elapsed)s] $*" | tee -a "$OUT/timeline.txt"; }

export_results() {  # refresh the summary and the few files that EXPORT gets back
  (
    flock 8
    $PY experiments/needle_eval.py --collect "$OUT" > "$OUT/collect.log" 2>&1 || note "collect failed (see collect.log)"
    if [ -n "$EXPORT" ]; then
      for f in ablation.csv ablation.png timeline.txt; do [ -f "$OUT/$f" ] && cp "$OUT/$f" "$EXPORT/"; done
      tar czf "$EXPORT/ablation_runs.tgz.tmp" -C "$(dirname "$OUT")" --exclude='*.lock' "$(basename "$OUT")" \
        && mv "$EXPORT/ablation_runs.tgz.tmp" "$EXPORT/ablation_runs.tgz"
    fi
  ) 8>"$OUT/.export.lock"
}

run_one() {
  parse_run "$1"
  local p=$RUN_NAME preset=$RUN_PRESET flags=$RUN_FLAGS d=$OUT/$RUN_NAME dump=$RUNS_DIR/$RUN_NAME t rc t0 f
  local eflags=""
  for f in $flags; do eflags="$eflags --override=$f"; done
  mkdir -p "$d"
  [ -n "$flags" ] && echo "$preset $flags" > "$d/variant"
  rm -rf "$dump"
  t=$(( BUDGET - EVAL_RESERVE - $(elapsed) ))
  if [ "$t" -lt 30 ]; then note "$p: no time left to train (skipped)"; echo "train skipped" > "$d/status"; return; fi
  note "$p: train start (steps $STEPS, limit ${t}s)"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout --kill-after=15 "$t" $PY -m nsa_flex.titan.cli --job.config_file titan_configs/ablation.toml \
    --nsa.masks "$preset" --job.dump_folder "$dump" --training.dataset_path "$DATA/fineweb_sample_2800.parquet" \
    --training.steps "$STEPS" --checkpoint.interval "$CKPT_EVERY" $flags $TRAIN_ARGS > "$d/train.log" 2>&1
  rc=$?
  echo $(( $(date +%s) - t0 )) > "$d/train_seconds"
  [ -f "$dump/metrics.jsonl" ] && cp "$dump/metrics.jsonl" "$d/"
  [ -d "$dump/tb" ] && rm -rf "$d/tb" && cp -r "$dump/tb" "$d/tb"
  local last; last=$(grep -o '"step": [0-9]*' "$d/metrics.jsonl" 2>/dev/null | tail -1 | grep -o '[0-9]*$')
  local ckpt; ckpt=$(ls -d "$dump"/checkpoint/step-* 2>/dev/null | sort -t- -k2 -n | tail -1)
  echo "train rc=$rc last_logged_step=${last:-none} checkpoint=${ckpt:-none}" > "$d/status"
  note "$p: train rc=$rc in $(cat "$d/train_seconds")s, last logged step ${last:-none}, checkpoint ${ckpt:+$(basename "$ckpt")}"
  grep -E "step: *[0-9]+ " "$d/train.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -2
  [ "$rc" -ne 0 ] && grep -E "Error|error:" "$d/train.log" | tail -3
  if [ -z "$ckpt" ]; then note "$p: no checkpoint, no evaluation"; export_results; return; fi
  (
    flock 9  # one evaluation at a time: they size their batches from the free GPU memory
    local te=$(( BUDGET - $(elapsed) - 15 ))
    if [ "$te" -lt 20 ]; then note "$p: no time left to evaluate"; echo "eval skipped" >> "$d/status"; exit 0; fi
    note "$p: eval start (limit ${te}s)"
    local t1; t1=$(date +%s)
    # shellcheck disable=SC2086
    timeout --kill-after=10 "$te" $PY experiments/needle_eval.py --config titan_configs/ablation.toml --override=--nsa.masks="$preset" $eflags \
      --checkpoint "$ckpt" --lengths "$LENGTHS" --depths "$DEPTHS" --trials "$TRIALS" --kinds "$KINDS" \
      --filler "$FILLER" --fineweb "$DATA/fineweb_sample_2800.parquet" --backend reference --mem-fraction 0.5 --tag "$p" \
      --out "$d/needle" $EVAL_ARGS > "$d/eval.log" 2>&1
    local erc=$?
    echo "eval rc=$erc" >> "$d/status"
    note "$p: eval rc=$erc in $(( $(date +%s) - t1 ))s"
    grep -E "length +[0-9]+:" "$d/eval.log"
    [ "$erc" -ne 0 ] && tail -3 "$d/eval.log"
  ) 9>"$OUT/.eval.lock"
  export_results
}

: > "$OUT/timeline.txt"
note "ablation: presets [$PRESETS], $STEPS steps, JOBS=$JOBS, BUDGET=${BUDGET}s, eval lengths $LENGTHS, filler $FILLER"
command -v nvidia-smi > /dev/null && nvidia-smi -L | tee -a "$OUT/timeline.txt"
for spec in $PRESETS; do
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 1; done
  run_one "$spec" &
  sleep 2  # stagger the starts (imports, dataset open)
done
wait
export_results
note "done"
cat "$OUT/ablation.csv"
