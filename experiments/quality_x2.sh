#!/usr/bin/env bash
# Issue 25's three quality runs and issue 24's trained-selection measurement on one machine with two
# GPUs, as one background job that outlives a device call (each call only waits and collects):
#   GPU 0: nsa                                   (experiments/quality_runs.sh: train, then its evaluations)
#   GPU 1: sliding_only + full_causal side by side (the same), then experiments/trained_selection_gpu.sh
# Every variant trains straight through (no segment boundary); if the job is killed, running the
# same command again resumes each variant from its latest checkpoint and skips finished stages.
#   bash experiments/quality_x2.sh OUT DATA
#     OUT   OUT/{nsa,full_causal,sliding_only}/ (quality_runs.sh's), OUT/perf/ (the measurement),
#           OUT/progress.txt (one line per finished part), OUT/ALL_DONE at the end
#     DATA  folder with tiktoken_cache/ and the FineWeb sample (titan tokens/s runs)
# Knobs: those of quality_runs.sh (TRAIN_ARGS, POS_DOCS, LENGTHS, DEPTHS, TRIALS, EVAL_ARGS, ...) and of
# trained_selection_gpu.sh (LAYOUTS, TESTS, TEST_K, TITAN); PERF=0 skips the measurement, PERF_FIRST=1
# runs it on GPU 1 before the two variants there (while NSA trains on GPU 0).
# Short-then-long training: a TOML with a [curriculum] short phase (TOML=titan_configs/quality_curriculum.toml;
# nsa_flex/titan/curriculum.py) runs both phases inside each variant's training stage.
set -uo pipefail
OUT=${1:?usage: quality_x2.sh OUT DATA}
DATA=${2:?usage: quality_x2.sh OUT DATA}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
echo $$ > "$OUT/driver.pid"   # a collecting call checks that the job still runs
export SEGMENT=${SEGMENT:-36000}
progress() { echo "[$(date -u +%FT%TZ)] $*" | tee -a "$OUT/progress.txt"; }
RUNS=${RUNS_DIR:-/tmp/nsa_quality_runs}
variant() {  # VARIANT GPU: quality_runs.sh until DONE, three tries at most
  local i
  for i in 1 2 3; do
    [ -f "$OUT/$1/DONE" ] && break
    CUDA_VISIBLE_DEVICES=$2 RUNS_DIR="$RUNS" \
      bash "$HERE/quality_runs.sh" "$1" "$OUT" "$DATA" 2>&1 | sed -u "s/^/[$1] /"
  done
  progress "$1: $([ -f "$OUT/$1/DONE" ] && echo done || echo "NOT done after 3 tries")"
}
variant nsa 0 &
gpu0=$!
perf() {
  if [ "${PERF:-1}" = 1 ] && [ ! -f "$OUT/perf/DONE" ]; then
    CUDA_VISIBLE_DEVICES=1 bash "$HERE/trained_selection_gpu.sh" "$OUT/perf" "$DATA" 2>&1 | sed -u "s/^/[perf] /"
    touch "$OUT/perf/DONE"; progress "perf: done"
  fi
}
( [ "${PERF_FIRST:-0}" = 1 ] && perf
  variant sliding_only 1 & variant full_causal 1 & wait
  perf ) &
gpu1=$!
wait $gpu0 $gpu1
touch "$OUT/ALL_DONE"; progress "all done"
