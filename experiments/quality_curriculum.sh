#!/usr/bin/env bash
# The curriculum's runs on one machine with four GPUs, as one background job that outlives a
# device call (each call only waits and collects): titan_configs/quality_curriculum.toml (short
# phase at 2048 on passkey documents, then 16384 on pysource + retrieval documents), then the
# evaluations of experiments/quality_runs.sh (position loss, selection statistics, needle), per GPU:
#   GPU 0: nsa   GPU 1: full_causal   GPU 2: sliding_only   GPU 3: nsa with --debug.seed=1 (OUT/seed1)
# Fewer GPUs (GPUS=2): the first GPUS variants of that list.
#   bash experiments/quality_curriculum.sh OUT DATA
#     OUT   OUT/<variant>/ (quality_runs.sh's: metrics_short.jsonl, metrics.jsonl, needle/, ...),
#           OUT/seed1/nsa/, OUT/progress.txt, OUT/ALL_DONE at the end
#     DATA  folder with tiktoken_cache/ (used even where TIKTOKEN_CACHE_DIR is set: the device
#           machines set one without gpt2)
# Knobs: GPUS (4), SEGMENT (seconds for training + evaluations, 3000: a variant still training then
# halts with a checkpoint and skips its evaluations), and those of quality_runs.sh (TRAIN_ARGS,
# LENGTHS, DEPTHS, TRIALS, POS_DOCS, SEL_LENGTHS, ...; defaults below).
# Then: python experiments/quality_report.py OUT --notes experiments/quality_reading.md
set -uo pipefail
OUT=${1:?usage: quality_curriculum.sh OUT DATA}
DATA=${2:?usage: quality_curriculum.sh OUT DATA}
HERE=$(cd "$(dirname "$0")" && pwd)
GPUS=${GPUS:-4}
mkdir -p "$OUT"
echo $$ > "$OUT/driver.pid"
export TOML=${TOML:-titan_configs/quality_curriculum.toml} SEGMENT=${SEGMENT:-3000} HALT_GRACE=${HALT_GRACE:-120}
export LENGTHS=${LENGTHS:-2048,4096,8192,16384,32768,65536} DEPTHS=${DEPTHS:-0,25,50,75,100}
export TRIALS=${TRIALS:-20} POS_DOCS=${POS_DOCS:-8} SEL_LENGTHS=${SEL_LENGTHS:-16384}
# bf16 evaluations, as trained: in fp32 full attention's SDPA takes its math kernel, O(T^2) memory
export EVAL_ARGS=${EVAL_ARGS:---dtype bfloat16}
RUNS=${RUNS_DIR:-/tmp/nsa_curriculum_runs}
export TIKTOKEN_CACHE_DIR=$(cd "$DATA" && pwd)/tiktoken_cache
progress() { echo "[$(date -u +%FT%TZ)] $*" | tee -a "$OUT/progress.txt"; }
variant() {  # VARIANT GPU OUT_SUBDIR [EXTRA_TRAIN_ARGS]
  CUDA_VISIBLE_DEVICES=$2 RUNS_DIR="$RUNS/$3" TRAIN_ARGS="${TRAIN_ARGS:-} ${4:-}" \
    bash "$HERE/quality_runs.sh" "$1" "$OUT/$3" "$DATA" 2>&1 | sed -u "s/^/[$3 $1] /"
  progress "$3 $1: $([ -f "$OUT/$3/$1/DONE" ] && echo done || echo "NOT done")"
}
plan=("nsa 0 . " "full_causal 1 . " "sliding_only 2 . " "nsa 3 seed1 --debug.seed=1")
pids=()
for i in $(seq 0 $((GPUS - 1))); do
  # shellcheck disable=SC2086
  variant ${plan[$i]} &
  pids+=($!)
done
wait "${pids[@]}"
date -u +%FT%TZ > "$OUT/ALL_DONE"
progress "all done"
