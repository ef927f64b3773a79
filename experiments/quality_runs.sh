#!/usr/bin/env bash
# Long-context quality, one variant: train titan_configs/quality_125m_16k.toml with --nsa.masks VARIANT
# in resumed segments, then evaluate the final checkpoint (needle retrieval, loss by position,
# selection statistics and traces) -- every invocation does the next SEGMENT seconds of that work.
#
# Usage (device machine, repo root); repeat the same command until it prints "DONE":
#   bash experiments/quality_runs.sh VARIANT OUT DATA [EXPORT]
#     VARIANT  nsa | full_causal | sliding_only
#     OUT      work folder: OUT/VARIANT/{train_*.log, metrics.jsonl, stages.txt, needle/, position_loss/,
#              selection/, DONE}; checkpoints go to RUNS_DIR/VARIANT (default /tmp/nsa_quality_runs)
#     DATA     folder with tiktoken_cache/ (e.g. ../shared/data); the corpus is the TOML's (pysource:
#              this machine's installed packages) unless TRAIN_DATA names a file
#     EXPORT   optional folder (the device tool's $OUT) that gets OUT/VARIANT as
#              quality_VARIANT.tgz (no checkpoints) after every invocation
#   then, with the three variants' OUT:  python experiments/quality_report.py OUT
#
# Stages, in order, each done once (OUT/VARIANT/stages.txt records them; the cheap evaluations first):
#   train      until the checkpoint of training.steps exists (a [curriculum] TOML: both phases, the
#              short phase's metrics as metrics_short.jsonl). A segment ends by the trainer's halt
#              file at its time limit (experiments/halt_after.sh; SIGTERM as the backstop): the
#              trainer halts after the current step and saves a full checkpoint (exit 4);
#              the next invocation resumes from it exactly (same TOML, data position and LR schedule).
#   position   python -m nsa_flex.eval --task position-loss (POS_SEQ tokens, VAL_DOCS).
#   selection  python -m nsa_flex.eval --task selection at SEL_LENGTHS (variants with a selection branch).
#   needle     python -m nsa_flex.eval (passkey + multikey, LENGTHS x DEPTHS x TRIALS) with
#              --time-limit and --resume: an evaluation longer than a segment goes on in the next one.
# Knobs (environment): SEGMENT (540 s per invocation), HALT_GRACE (90 s: a halted step + checkpoint),
#   TRAIN_DATA (unset: the TOML's dataset; a file: --training.dataset_path and the needle's --fineweb),
#   VAL_DOCS (pysource: the corpus's validation packages; or a parquet / jsonl file),
#   VAL_JOIN (0 for a corpus of long documents; 1: short documents, joined),
#   LENGTHS (4096,8192,16384,32768,65536), DEPTHS (0,10,..,100), TRIALS (20), KINDS (passkey,multikey),
#   FILLER (auto: the training data's kind), POS_SEQ (16384), POS_DOCS (16), SEL_LENGTHS (32768,65536), TOML, RUNS_DIR,
#   TRAIN_ARGS (extra trainer flags --section.field=value / --section.no-flag, also given to every evaluation as
#   --override), EVAL_ARGS (extra flags of every evaluation), EVALS (1; 0: done after training, e.g. a
#   pre-training phase whose weights another run loads), PYTHON (python).
set -uo pipefail
USAGE="usage: quality_runs.sh VARIANT OUT DATA [EXPORT]"
VARIANT=${1:?$USAGE}
OUT=${2:?$USAGE}
DATA=${3:?$USAGE}
EXPORT=${4:-}
case "$VARIANT" in nsa|full_causal|sliding_only) ;;
  *) echo "VARIANT must be one of nsa, full_causal, sliding_only; got '$VARIANT'" >&2; exit 2;; esac
SEGMENT=${SEGMENT:-540}
HALT_GRACE=${HALT_GRACE:-90}
case "$SEGMENT" in ''|*[!0-9]*) echo "SEGMENT must be a number of seconds, got '$SEGMENT'" >&2; exit 2;; esac
[ -d "$DATA" ] || { echo "DATA=$DATA is not a folder" >&2; exit 2; }
TRAIN_DATA=${TRAIN_DATA:-}
VAL_DOCS=${VAL_DOCS:-pysource}
VAL_JOIN=${VAL_JOIN:-0}
[ -z "$TRAIN_DATA" ] || [ -f "$TRAIN_DATA" ] || { echo "TRAIN_DATA=$TRAIN_DATA: no such file" >&2; exit 2; }
[ "$VAL_DOCS" = pysource ] || [ -f "$VAL_DOCS" ] || { echo "VAL_DOCS=$VAL_DOCS: no such file" >&2; exit 2; }
LENGTHS=${LENGTHS:-4096,8192,16384,32768,65536}
DEPTHS=${DEPTHS:-0,10,20,30,40,50,60,70,80,90,100}
TRIALS=${TRIALS:-20}
KINDS=${KINDS:-passkey,multikey}
FILLER=${FILLER:-auto}
POS_SEQ=${POS_SEQ:-16384}
POS_DOCS=${POS_DOCS:-16}
SEL_LENGTHS=${SEL_LENGTHS:-32768,65536}
TOML=${TOML:-titan_configs/quality_125m_16k.toml}
RUNS_DIR=${RUNS_DIR:-/tmp/nsa_quality_runs}
TRAIN_ARGS=${TRAIN_ARGS:-}
EVAL_ARGS=${EVAL_ARGS:-}
EVALS=${EVALS:-1}
PY=${PYTHON:-python}
[ -f "$TOML" ] || { echo "TOML=$TOML: no such file" >&2; exit 2; }
for f in $TRAIN_ARGS; do
  [[ "$f" == --?*.?* ]] || { echo "TRAIN_ARGS: flag '$f' must look like --section.field=value or --section.no-field" >&2; exit 2; }
done
JOIN=""; [ "$VAL_JOIN" = 1 ] && JOIN="--join"
D=$OUT/$VARIANT
DUMP=$RUNS_DIR/$VARIANT
mkdir -p "$D" "$DUMP" ${EXPORT:+"$EXPORT"}
D=$(cd "$D" && pwd)
DATA=$(cd "$DATA" && pwd)
[ -d "$DATA/tiktoken_cache" ] && export TIKTOKEN_CACHE_DIR=${TIKTOKEN_CACHE_DIR:-$DATA/tiktoken_cache}
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
START=$(date +%s)
left() { echo $(( SEGMENT - ($(date +%s) - START) )); }
note() { echo "[$(date -u +%FT%TZ) +$(( $(date +%s) - START ))s] $VARIANT: $*" | tee -a "$D/timeline.txt"; }
done_stage() { grep -qx "$1" "$D/stages.txt" 2>/dev/null; }
mark() { echo "$1" >> "$D/stages.txt"; }
OVR="--override=--nsa.masks=$VARIANT"
DATA_ARGS=""; FINEWEB=""
[ -n "$TRAIN_DATA" ] && DATA_ARGS="--training.dataset_path $TRAIN_DATA --validation.dataset_path $VAL_DOCS" \
  && FINEWEB="--fineweb $TRAIN_DATA"
for f in $TRAIN_ARGS; do OVR="$OVR --override=$f"; done

export_results() {
  [ -n "$EXPORT" ] || return 0
  tar czf "$EXPORT/quality_$VARIANT.tgz" -C "$(dirname "$D")" "$(basename "$D")"
}
finish() {  # $1: why this invocation ends
  export_results
  if [ -f "$D/DONE" ]; then note "DONE (all stages)"; else note "$1; run the same command again"; fi
  exit 0
}
latest_ckpt() { ls -d "$DUMP"/checkpoint/step-* 2>/dev/null | sort -t- -k2 -n | tail -1; }

# ------------------------------------------------------------------ train
if ! done_stage train; then
  # shellcheck disable=SC2086
  STEPS=$($PY -c "import sys; from nsa_flex.apps.generate import load_job_config
print(load_job_config(sys.argv[1], sys.argv[2:]).training.steps)" "$TOML" --nsa.masks="$VARIANT" $TRAIN_ARGS) \
    || { echo "cannot read training.steps from $TOML with TRAIN_ARGS" >&2; exit 2; }
  t=$(( $(left) - HALT_GRACE ))
  [ "$t" -ge 30 ] || finish "no time left to train in this segment"
  ck=$(latest_ckpt)
  note "train: steps $STEPS, resuming from ${ck:+$(basename "$ck")}${ck:-scratch}, halt file after ${t}s"
  n=$(ls "$D"/train_*.log 2>/dev/null | wc -l)
  # the segment's end: the trainer's halt file at t (a curriculum's phases have one each), timeout's
  # SIGTERM (the same halt) half the grace later where it has not stopped, SIGKILL at the grace's end
  # shellcheck disable=SC2086
  timeout --preserve-status -s TERM -k "$(( HALT_GRACE / 2 ))" "$(( t + HALT_GRACE / 2 ))" $PY -m nsa_flex.titan.cli \
    --job.config_file "$TOML" --job.dump_folder "$DUMP" $DATA_ARGS --nsa.masks "$VARIANT" $TRAIN_ARGS \
    > "$D/train_$n.log" 2>&1 &
  tpid=$!
  bash experiments/halt_after.sh "$t" "$tpid" "$DUMP/short/HALT" "$DUMP/HALT" > >(while read -r l; do note "train: $l"; done) &
  wpid=$!
  wait "$tpid"
  rc=$?
  kill "$wpid" 2>/dev/null; wait "$wpid" 2>/dev/null
  rm -f "$DUMP/short/HALT" "$DUMP/HALT"  # the phase that did not run leaves its file unread
  [ -f "$DUMP/metrics.jsonl" ] && cp "$DUMP/metrics.jsonl" "$D/"
  [ -f "$DUMP/short/metrics.jsonl" ] && cp "$DUMP/short/metrics.jsonl" "$D/metrics_short.jsonl"  # [curriculum]
  ck=$(latest_ckpt)
  note "train: rc=$rc, checkpoint ${ck:+$(basename "$ck")}"
  # exit 4: halted at the segment's end with a checkpoint (nsa_flex.titan.ops.EXIT_HALTED): resume next time
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 4 ]; then grep -E "Error|error:" "$D/train_$n.log" | tail -3; finish "training failed (rc=$rc, $D/train_$n.log)"; fi
  [ "${ck##*step-}" = "$STEPS" ] || finish "training halted at ${ck:+$(basename "$ck")}"
  mark train
fi
if [ "$EVALS" = 0 ]; then date -u +%FT%TZ > "$D/DONE"; finish "done (training only: EVALS=0)"; fi
CKPT=$(latest_ckpt)
[ -n "$CKPT" ] || { note "no checkpoint in $DUMP/checkpoint (was this machine restarted? train again)"; exit 1; }

# ------------------------------------------------------------------ evaluations
if ! done_stage position; then
  [ "$(left)" -ge 60 ] || finish "no time left for the position loss in this segment"
  note "position: $POS_DOCS sequences of $POS_SEQ from $VAL_DOCS"
  # shellcheck disable=SC2086
  timeout -k 10 "$(left)" $PY -m nsa_flex.eval --task position-loss --config "$TOML" $OVR --checkpoint "$CKPT" \
    --docs "$VAL_DOCS" $JOIN --seq-len "$POS_SEQ" --max-docs "$POS_DOCS" --tag "$VARIANT" \
    --out "$D/position_loss" $EVAL_ARGS > "$D/position_loss.log" 2>&1 \
    || { tail -3 "$D/position_loss.log"; finish "position loss failed or was cut ($D/position_loss.log)"; }
  mark position
fi
if ! done_stage selection; then
  if [ "$VARIANT" = nsa ]; then
    [ "$(left)" -ge 60 ] || finish "no time left for the selection statistics in this segment"
    note "selection: lengths $SEL_LENGTHS"
    # shellcheck disable=SC2086
    timeout -k 10 "$(left)" $PY -m nsa_flex.eval --task selection --config "$TOML" $OVR --checkpoint "$CKPT" \
      --docs "$VAL_DOCS" $JOIN --lengths "$SEL_LENGTHS" --tag "$VARIANT" --out "$D/selection" $EVAL_ARGS \
      > "$D/selection.log" 2>&1 \
      || { tail -3 "$D/selection.log"; finish "selection statistics failed or were cut ($D/selection.log)"; }
  fi
  mark selection
fi
if ! done_stage needle; then
  t=$(( $(left) - 20 ))
  [ "$t" -ge 60 ] || finish "no time left for the needle evaluation in this segment"
  note "needle: $KINDS at $LENGTHS, $TRIALS trials, time limit ${t}s"
  # shellcheck disable=SC2086
  timeout -k 10 $(( t + 60 )) $PY -m nsa_flex.eval --config "$TOML" $OVR --checkpoint "$CKPT" --lengths "$LENGTHS" \
    --depths "$DEPTHS" --trials "$TRIALS" --kinds "$KINDS" --filler "$FILLER" $FINEWEB \
    --resume --time-limit "$t" --tag "$VARIANT" --out "$D/needle" $EVAL_ARGS >> "$D/needle.log" 2>&1
  rc=$?
  grep -E "length +[0-9]+:" "$D/needle.log" | tail -10
  [ "$rc" -eq 0 ] || finish "needle evaluation failed or was cut (rc=$rc, $D/needle.log)"
  grep -q '"complete": true' "$D/needle/meta.json" || finish "needle evaluation not complete yet"
  mark needle
fi
date -u +%FT%TZ > "$D/DONE"
finish "done"
