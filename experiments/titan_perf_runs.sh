#!/usr/bin/env bash
# Issue 14 item 6: torchtitan tokens/s and peak memory, NSA against the same model with SDPA full
# attention (masks = "full_causal": the causal branch runs SDPA on GPU), one GPU, bf16, compile on,
# local batch 1, the local FineWeb sample. Each run: STEPS steps, logged every step; the summary
# (experiments/titan_perf_csv.py) takes the median tps of the steps after WARMUP and the largest
# memory figure torchtitan printed.
# Usage (device machine, repo root, torchtitan wheels on PYTHONPATH):
#   bash experiments/titan_perf_runs.sh OUT DATA_DIR ["32768:125M 8192:125M"] [STEPS] [LIMIT_S]
# TITAN_EXTRA: more torchtitan flags for every run of the sweep (both attentions), e.g.
#   TITAN_EXTRA="--activation_checkpoint.mode full" for the 1B flavor at 32k.
# MASTER_PORT: torchrun's rendezvous port (default 29500; two sweeps at once need two ports).
# NSA_EXTRA: flags for the NSA runs only (e.g. "--nsa.recompute cmp_win"), NSA_TAG: their label
#   (no '_'; the runs and titan.csv's attention column read "nsa+TAG"); ATTNS: which of
#   "nsa full" to run (default both).
set -uo pipefail
OUT=${1:?out dir}; DATA=${2:?data dir}; PLAN=${3:-"32768:125M 8192:125M"}; STEPS=${4:-40}
LIMIT=${5:-200}
mkdir -p "$OUT"
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken_cache PYTHONUNBUFFERED=1
case ${NSA_TAG:-} in *_*) echo "NSA_TAG=$NSA_TAG: no '_' (log names are ATTN_FLAVOR_SEQ)"; exit 2 ;; esac
for item in $PLAN; do
  seq=${item%%:*}; flavor=${item##*:}
  for attn in ${ATTNS:-nsa full}; do
    # shellcheck disable=SC2206  # flags split on spaces, as on a command line
    extra=(${TITAN_EXTRA:-}); label=$attn
    if [ "$attn" = nsa ]; then extra+=(${NSA_EXTRA:-}); label=nsa${NSA_TAG:++$NSA_TAG}; fi
    cfg=titan_configs/nsa_125m_fineweb_edu.toml
    [ "$attn" = full ] && cfg=titan_configs/full_attn_125m_fineweb_edu.toml
    name=${label}_${flavor}_${seq}
    # a fresh dump folder per run: never a resume from an earlier run's last-step checkpoint
    dump=$(mktemp -d /tmp/titan_perf.XXXXXX)/$name
    echo "== $name (t=${SECONDS}s)"
    timeout "$LIMIT" torchrun --nproc_per_node=1 --master_port "${MASTER_PORT:-29500}" -m nsa_flex.titan.train --job.config_file $cfg \
      --model.flavor "$flavor" --training.seq_len "$seq" --training.local_batch_size 1 \
      --training.dataset_path "$DATA/fineweb_sample_2800.parquet" --training.steps "$STEPS" \
      --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 \
      --job.dump_folder "$dump" "${extra[@]}" > "$OUT/$name.log" 2>&1
    echo "   rc=$? t=${SECONDS}s"; grep -a "step:" "$OUT/$name.log" | tail -2 | cut -c1-200
    rm -rf "$(dirname "$dump")"
    # after every run, so a cut-off sweep still leaves its table
    python experiments/titan_perf_csv.py "$OUT"/*_*_*.log --out "$OUT/titan.csv"
  done
done
