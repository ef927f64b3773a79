#!/usr/bin/env bash
# One long job on a lent GPU machine across several device calls (each call at most 10 minutes; the
# machine is held only while calls follow each other within its idle release, ~30 s, so chain
# them without pause). Run from the repository root there.
#   bash experiments/device_job.sh start LIMIT 'COMMAND'   install the carried wheels (.whl/*.whl,
#        into /tmp/site), print torch / GPUs, copy the working tree to /tmp/job/repo and start
#        COMMAND there with setsid (it outlives the call; its output in /tmp/job/out, given to it as
#        $JOB_OUT; console in /tmp/job/job.log), then poll as below
#   bash experiments/device_job.sh poll LIMIT              wait until the job ends or LIMIT
#        seconds pass, print the tail of its console, of every progress.txt under /tmp/job/out
#        and of each side command's log, and tar /tmp/job/out into $OUT/job.tgz (the device
#        call's returned folder)
#   bash experiments/device_job.sh side 'COMMAND'          beside the started job (a GPU test, a
#        measurement): COMMAND in the job's copied tree and wheels, with setsid, its output and
#        exit status in /tmp/job/out/side-N.log, returned by every later poll; so a device call
#        that ends (or is cut at its limit) before COMMAND does loses none of its output
# The gate of experiments/NOTES.md 91, for example (wheels: torchtitan 0.2.2, tyro, tomli,
# docstring-parser, typeguard, torchdata, datasets 4.3.0 with dill 0.3.8 and multiprocess 0.70.16,
# which import beside the H200 image's pyarrow and huggingface-hub; .data/tiktoken_cache a copy of
# ../shared/data/tiktoken_cache; carry [".whl", ".data"] on every call):
#   bash experiments/device_job.sh start 540 'STEPS=9000 VAL_FREQ=250 CKPT_EVERY=2000 \
#     EVAL_EACH_CKPT=1 TRAIN_S=1360 PLAN="..." bash experiments/retrieval_gate.sh $JOB_OUT/gate .data'
#   bash experiments/device_job.sh poll 540; bash experiments/device_job.sh poll 420
# JOB_DIR: the job's folder (/tmp/job above).
# Compile cache: the job's torch.compile cache (inductor's FX graphs, AOT autograd, Triton kernels)
# lives in .cache/inductor of the copied tree, seeded from a carried .cache/inductor.txz; the last
# poll returns it xz-compressed (about a third of gzip's size for these caches) in parts of 15 MiB
# (what comes back is at most 16 MiB a file), $OUT/inductor.txz.0, .1, ..., where it fits in 56
# MiB. Join them into the checkout's .cache/ (git-ignored):
# `mkdir -p .cache && cat FILES_AT/inductor.txz.* > .cache/inductor.txz`, and carry ".cache" too
# (the tracked tree and every carried path travel in 64 MiB together): the next machine's runs of
# the same shapes and code skip most of their compile.
set -uo pipefail
MODE=${1:?usage: device_job.sh start LIMIT COMMAND | poll LIMIT | side COMMAND}
LIMIT=${2:?usage: device_job.sh start LIMIT COMMAND | poll LIMIT | side COMMAND}
JOB=${JOB_DIR:-/tmp/job}
if [ "$MODE" = side ]; then
  CMD=$2
  [ -d "$JOB/repo" ] || { echo "device_job.sh: no job on this machine to run beside (start one first)" >&2; exit 4; }
  N=$(( $(ls "$JOB/out" | grep -c '^side-') + 1 ))
  LOG=$JOB/out/side-$N.log
  echo "side $N: $CMD" > "$LOG"
  (cd "$JOB/repo" && PYTHONPATH=/tmp/site:$JOB/repo${PYTHONPATH:+:$PYTHONPATH} \
    TORCHINDUCTOR_CACHE_DIR=$JOB/repo/.cache/inductor setsid nohup bash -c \
    "($CMD); echo \"side $N: rc \$?\"" >> "$LOG" 2>&1 < /dev/null &)
  echo "side $N started: $CMD (output in $LOG, returned by the next poll)"
  exit 0
fi
case "$LIMIT" in ''|*[!0-9]*) echo "device_job.sh: LIMIT=$LIMIT: allowed a whole number of seconds" >&2; exit 2;; esac

if [ "$MODE" = start ]; then
  CMD=${3:?usage: device_job.sh start LIMIT COMMAND}
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl 2>&1 | tail -2
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import torch; print('torch', torch.__version__, 'GPUs', torch.cuda.device_count())" || exit 3
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  rm -rf "$JOB" && mkdir -p "$JOB/out" && cp -r . "$JOB/repo"
  if [ -f "$JOB/repo/.cache/inductor.txz" ]; then
    tar xJf "$JOB/repo/.cache/inductor.txz" -C "$JOB/repo/.cache" && rm "$JOB/repo/.cache/inductor.txz"
  fi
  git rev-parse --short HEAD 2>/dev/null > "$JOB/out/commit" || true
  mkdir -p "$JOB/repo/.cache/inductor"
  echo "compile cache: $(du -sh "$JOB/repo/.cache/inductor" | cut -f1) carried"
  (cd "$JOB/repo" && JOB_OUT=$JOB/out PYTHONPATH=$PYTHONPATH:$JOB/repo \
    TORCHINDUCTOR_CACHE_DIR=$JOB/repo/.cache/inductor setsid nohup bash -c \
    "($CMD); echo \$? > $JOB/rc" > "$JOB/job.log" 2>&1 < /dev/null &)
  echo "started: $CMD"
elif [ "$MODE" != poll ]; then
  echo "device_job.sh: mode $MODE: allowed start, poll or side" >&2; exit 2
fi

[ -d "$JOB" ] || { echo "device_job.sh: no job on this machine (a new machine: the last was reclaimed)"; exit 4; }
T0=$(date +%s)
while [ $(( $(date +%s) - T0 )) -lt "$LIMIT" ] && [ ! -f "$JOB/rc" ]; do sleep 1; done
echo "== job: $([ -f "$JOB/rc" ] && echo "ended, rc $(cat "$JOB/rc")" || echo "running") after $(( $(date +%s) - T0 ))s of this poll"
tail -n 15 "$JOB/job.log"
find "$JOB/out" -name progress.txt | while read -r p; do echo "== $p"; tail -n 25 "$p"; done
for p in "$JOB"/out/side-*.log; do [ -f "$p" ] && { echo "== $p"; tail -n 15 "$p"; }; done
cp "$JOB/job.log" "$JOB/out/" 2>/dev/null
mkdir -p "${OUT:-/tmp/device_out}"
tar czf "${OUT:-/tmp/device_out}/job.tgz" -C "$JOB" out
if [ -f "$JOB/rc" ]; then  # the job is done: its compile cache, in parts, where it fits what comes back
  C=$JOB/inductor.txz
  tar cf - -C "$JOB/repo/.cache" inductor | xz -6 -T0 > "$C"
  if [ "$(stat -c %s "$C")" -le $((56 * 1024 * 1024)) ]; then
    split -b 15m -d -a 1 "$C" "${OUT:-/tmp/device_out}/inductor.txz."
  else
    echo "compile cache $(du -h "$C" | cut -f1) compressed: over 56 MiB, not returned"
  fi
fi
ls -la "${OUT:-/tmp/device_out}"
