#!/usr/bin/env bash
# The retrieval gate (>= 95% passkey at the short length before the long runs): the curriculum's short phase alone
# (titan_configs/quality_curriculum.toml, [curriculum] short: 125M at 2048 x 16 on generated passkey
# documents), one variant per GPU, side by side, then the passkey evaluation of each final checkpoint
# at the training length. One background job that outlives a device call: start it with setsid,
# then poll OUT/progress.txt (and `python experiments/curriculum_status.py $RUNS`) in later calls.
#   bash experiments/retrieval_gate.sh OUT DATA
#     OUT   OUT/<name>/{train.log, metrics.jsonl, needle/, needle.log[, needle_step-N/]}, OUT/progress.txt,
#           OUT/ALL_DONE
#     DATA  folder with tiktoken_cache/ (used even where TIKTOKEN_CACHE_DIR is set: the device
#           machines set one without gpt2)
# PLAN: one entry per GPU, "MASKS NAME [EXTRA TRAIN FLAGS]" separated by ";". Default: "nsa nsa;
# full_causal full_causal; nsa nsa_seed1 --debug.seed=1; nsa nsa_seed2 --debug.seed=2" (whether
# NSA forms the copy depends on the seed, experiments/NOTES.md 83: how often it does, beside full
# attention). The documents' filler is the TOML's
# (training.passkey_filler in [curriculum] short; the evaluation's follows).
# Other knobs: STEPS (the short phase's training.steps, e.g. 7000 where a session's device time is
# short: the cosine then ends there; default the TOML's; an entry's own flag for an item of
# [curriculum] short overrides it for that entry, e.g. "--training.steps=12000" for full
# attention's faster steps, or "--training.passkey_questions=3"), VAL_FREQ (its validation.freq, e.g. 250:
# each validation of 128 documents costs NSA ~0.7 s; default the TOML's), CKPT_EVERY (its
# checkpoint.interval, e.g. 2000: each save of the 125M model and optimizer costs ~6 s; the halt
# at TRAIN_S saves one anyway; default the TOML's), TRAIN_S (seconds from the start before each
# run's halt, 1440: the trainer's halt file makes it save a checkpoint and exit 4, the evaluation
# then reads it; timeout's SIGTERM, the same halt, HALT_GRACE_S (120) later where it has not
# stopped; an entry with less than MIN_TRAIN_S (60) left does not start; on an H100 NSA's step at
# 2048 x 16 is ~0.16 s, full attention's ~0.09, start and
# compile ~2-3 min: experiments/NOTES.md 83), TOML, RUNS (/tmp/nsa_gate_runs), DEPTHS
# (0,25,50,75,100), TRIALS (20), GPUS (the
# GPUs of each plan entry, e.g. "1 3" beside other jobs on a larger host; default 0 1 2 ...; an entry
# "0,1" trains that variant data-parallel over those GPUs under torchrun with the same global batch:
# the short phase's local batch sizes divided by their number, in RUNS/NAME.toml; at 2048 on H100s
# two GPUs gave NSA fewer tokens/s than one: experiments/NOTES.md 76 and 78), EVAL_EACH_CKPT (1:
# while a run trains, every POLL_S (30) seconds its metrics.jsonl is copied into OUT/NAME and each
# newly completed checkpoint (its .metadata written) gets the passkey evaluation in
# OUT/NAME/needle_step-N, on the run's first GPU beside the training: what a machine lost before the
# end still leaves in OUT; 0, the default: off), LONG_LENGTHS (e.g. 4096,8192,16384: after the
# final evaluation, the same passkey evaluation of the final checkpoint at these lengths, beyond
# the one it trained at, into OUT/NAME/needle_long: how far the short phase's copy reaches
# before any long training; default empty: off).
set -uo pipefail
OUT=${1:?usage: retrieval_gate.sh OUT DATA}
DATA=${2:?usage: retrieval_gate.sh OUT DATA}
TOML=${TOML:-titan_configs/quality_curriculum.toml}
RUNS=${RUNS:-/tmp/nsa_gate_runs}
TRAIN_S=${TRAIN_S:-1440}
PLAN=${PLAN:-nsa nsa; full_causal full_causal; nsa nsa_seed1 --debug.seed=1; nsa nsa_seed2 --debug.seed=2}
DEPTHS=${DEPTHS:-0,25,50,75,100}
TRIALS=${TRIALS:-20}
PY=${PYTHON:-python}
mkdir -p "$OUT" "$RUNS"
OUT=$(cd "$OUT" && pwd)
export TIKTOKEN_CACHE_DIR=$(cd "$DATA" && pwd)/tiktoken_cache PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
case "${EVAL_EACH_CKPT:=0}" in 0|1) ;; *) echo "retrieval_gate.sh: EVAL_EACH_CKPT=$EVAL_EACH_CKPT: allowed 0 or 1" >&2; exit 2;; esac
START=$(date +%s)
progress() { echo "[$(date -u +%FT%TZ) +$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/progress.txt"; }
# the short phase's sequence length and filler ([curriculum] short items, else the TOML's
# [training]) and the names of its items (as flags: --training.seq_len,...)
read -r SEQ FILLER SHORT_ITEMS < <($PY -c "import sys, tomllib; c = tomllib.load(open(sys.argv[1], 'rb'))
items = dict(i.split('=', 1) for i in c['curriculum']['short'] if '=' in i)
filler = items.get('training.passkey_filler', c['training'].get('passkey_filler', 'sentences'))
print(items['training.seq_len'], 'synthetic' if filler == 'sentences' else filler,
      ','.join('--' + k for k in items))" "$TOML") \
  || { echo "retrieval_gate.sh: $TOML has no training.seq_len in [curriculum] short" >&2; exit 2; }

# entry_toml TOML N STEPS VAL_FREQ CKPT_EVERY [ITEM=VALUE ...]: TOML with the short phase's
# training/validation local batch sizes divided by N (the same global batch on N data-parallel
# GPUs), where STEPS / VAL_FREQ / CKPT_EVERY are not empty its training.steps / validation.freq /
# checkpoint.interval set to them, and each ITEM (an item of [curriculum] short) set to VALUE;
# exits 2 where a batch size does not divide or a value is no count
entry_toml() {
  $PY - "$@" <<'PY'
import re, sys
text, n = open(sys.argv[1]).read(), int(sys.argv[2])
def per_gpu(m):
    if int(m[2]) % n:
        sys.exit(f"retrieval_gate.sh: {m[1]}.local_batch_size={m[2]} is not divisible by {n} GPUs")
    return f'"{m[1]}.local_batch_size={int(m[2]) // n}"'
text = re.sub(r'"(training|validation)\.local_batch_size=(\d+)"', per_gpu, text)
for knob, item, value in (("STEPS", "training.steps", sys.argv[3]), ("VAL_FREQ", "validation.freq", sys.argv[4]),
                          ("CKPT_EVERY", "checkpoint.interval", sys.argv[5])):
    if value:
        if not value.isdigit() or int(value) < 1:
            sys.exit(f"retrieval_gate.sh: {knob}={value!r}: allowed a whole number >= 1")
        text, k = re.subn(rf'"{re.escape(item)}=\d+"', f'"{item}={int(value)}"', text)
        if k != 1:
            sys.exit(f"retrieval_gate.sh: {knob} needs one \"{item}=N\" item in [curriculum] short")
for pair in sys.argv[6:]:  # an entry's own flags for short-phase items
    item, value = pair.split("=", 1)
    text = re.sub(rf'"{re.escape(item)}=[^"]*"', lambda m: f'"{item}={value}"', text, count=1)
print(text, end="")
PY
}

variant() {  # GPUS MASKS NAME [EXTRA_TRAIN_ARGS...]; GPUS "0", or "0,1" for data parallel
  local gpu=$1 masks=$2 name=$3; shift 3
  local d=$OUT/$name dump=$RUNS/$name toml=$TOML launch=(-m nsa_flex.titan.cli)
  # an entry's flags --S.F=V for items of the short phase (e.g. --training.steps=12000,
  # --training.passkey_questions=3) go into its TOML, over STEPS: the phase's items override the
  # command line
  local steps=${STEPS:-} a rest=() items=()
  for a in "$@"; do
    if [[ $a == --*=* && ",$SHORT_ITEMS," == *",${a%%=*},"* ]]; then items+=("${a#--}"); else rest+=("$a"); fi
  done
  set -- ${rest[@]+"${rest[@]}"}
  local n=$(( $(tr -cd , <<< "$gpu" | wc -c) + 1 ))
  # a fresh record of this run: an earlier run's copies in OUT would pass for this one's if this
  # one is cut before its own copy (its training resumes from RUNS/NAME where that holds a run)
  rm -rf "$d/metrics.jsonl" "$d"/needle "$d"/needle.log "$d"/needle_step-* "$d"/needle_long*
  mkdir -p "$d"
  if [ "$n" -gt 1 ] || [ -n "$steps${VAL_FREQ:-}${CKPT_EVERY:-}" ] || [ ${#items[@]} -gt 0 ]; then
    toml=$RUNS/$name.toml
    entry_toml "$TOML" "$n" "$steps" "${VAL_FREQ:-}" "${CKPT_EVERY:-}" ${items[@]+"${items[@]}"} > "$toml" 2> "$d/toml.err" \
      || { progress "$name: $(cat "$d/toml.err")"; return; }
  fi
  [ "$n" -gt 1 ] && launch=(-m torch.distributed.run --standalone --nproc_per_node "$n" -m nsa_flex.titan.train)
  local t=$(( TRAIN_S - ($(date +%s) - START) ))
  if [ "$t" -lt "${MIN_TRAIN_S:-60}" ]; then progress "$name: no time left to train"; return; fi
  progress "$name: training (masks $masks $*, GPUs $gpu) for at most ${t}s"
  # the time limit: the trainer's halt file at t (it stops after the step it is in, saves a
  # checkpoint and exits 4; no signal involved), timeout's SIGTERM (the same halt) HALT_GRACE_S
  # later where it has not stopped, SIGKILL 150 s after that
  CUDA_VISIBLE_DEVICES=$gpu timeout --preserve-status -s TERM -k 150 "$(( t + ${HALT_GRACE_S:-120} ))" \
    $PY "${launch[@]}" --job.config_file "$toml" --job.dump_folder "$dump" --nsa.masks "$masks" \
    --curriculum.phase short "$@" > "$d/train.log" 2>&1 &
  local tpid=$! seen="" ck
  bash experiments/halt_after.sh "$t" "$tpid" "$dump/short/HALT" > >(while read -r l; do progress "$name: $l"; done) &
  local wpid=$!
  while [ "$EVAL_EACH_CKPT" = 1 ] && kill -0 "$tpid" 2>/dev/null; do
    sleep "${POLL_S:-30}"
    cp "$dump/short/metrics.jsonl" "$d/" 2>/dev/null
    ck=$(latest_ckpt "$dump")
    if [ -n "$ck" ] && [ "$ck" != "$seen" ] && kill -0 "$tpid" 2>/dev/null; then
      seen=$ck
      evaluate "$gpu" "$ck" "$d/needle_$(basename "$ck")" "$masks" "$SEQ" "$@"
    fi
  done
  wait "$tpid"
  local rc=$?
  kill "$wpid" 2>/dev/null; wait "$wpid" 2>/dev/null
  cp "$dump/short/metrics.jsonl" "$d/" 2>/dev/null
  ck=$(latest_ckpt "$dump")
  progress "$name: training rc=$rc (0 done, 4 halted at the time limit with its checkpoint, 137 killed), checkpoint ${ck:+$(basename "$ck")}"
  if [ -z "$ck" ]; then grep -E "Error|error:" "$d/train.log" | tail -3; return; fi
  evaluate "$gpu" "$ck" "$d/needle" "$masks" "$SEQ" "$@"
  [ -z "${LONG_LENGTHS:-}" ] || evaluate "$gpu" "$ck" "$d/needle_long" "$masks" "$LONG_LENGTHS" "$@"
}

latest_ckpt() {  # DUMP -> the newest completed short-phase checkpoint (DCP writes .metadata last)
  local c
  for c in $(ls -d "$1"/short/checkpoint/step-* 2>/dev/null | sort -t- -k2 -n -r); do
    [ -f "$c/.metadata" ] && { echo "$c"; return; }
  done
}

evaluate() {  # GPUS CHECKPOINT DIR MASKS LENGTHS [EXTRA_TRAIN_ARGS...]: the passkey evaluation at
  # LENGTHS (comma-separated) into DIR
  local gpu=$1 ck=$2 dir=$3 masks=$4 lengths=$5 name; shift 5
  name=$(basename "$(dirname "$dir")")
  # the model's own [nsa] flags (e.g. --nsa.phi=mlp) build the evaluated model too
  local ov=(--override="--nsa.masks=$masks") f
  for f in "$@"; do [[ $f == --nsa.* ]] && ov+=(--override="$f"); done
  CUDA_VISIBLE_DEVICES=${gpu%%,*} $PY -m nsa_flex.eval --config "$TOML" "${ov[@]}" \
    --checkpoint "$ck" --lengths "$lengths" --depths "$DEPTHS" --trials "$TRIALS" --kinds passkey \
    --filler "$FILLER" --dtype bfloat16 --tag "$name" --out "$dir" > "$dir.log" 2>&1
  local rc=$?
  progress "$name: $(basename "$dir") of $(basename "$ck") rc=$rc $(grep -E "length +[0-9]+:" "$dir.log" | tail -n "$(tr -cd , <<< "$lengths," | wc -c)" | paste -sd ';')"
}

IFS=';' read -ra plan <<< "$PLAN"
read -ra gpus <<< "${GPUS:-}"
pids=()
for i in "${!plan[@]}"; do
  # shellcheck disable=SC2086
  variant "${gpus[$i]:-$i}" ${plan[$i]} &
  pids+=($!)
done
wait "${pids[@]}"
date -u +%FT%TZ > "$OUT/ALL_DONE"
progress "all done"
