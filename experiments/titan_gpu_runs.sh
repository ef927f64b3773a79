#!/usr/bin/env bash
# Issue 3 GPU runs: nsa_125m_fineweb_edu.toml and its full-attention baseline on one GPU,
# seq_len 8192, bf16, compile on, >= 200 steps, data from the local FineWeb sample.
# Usage (device machine, repo root): bash experiments/titan_gpu_runs.sh OUT_DIR DATA_DIR [STEPS] [TIMEOUT_S]
set -uo pipefail
OUT=${1:?out dir}; DATA=${2:?data dir}; STEPS=${3:-200}; LIMIT=${4:-270}
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken_cache PYTHONUNBUFFERED=1
for run in nsa_125m_fineweb_edu full_attn_125m_fineweb_edu; do
  timeout "$LIMIT" torchrun --nproc_per_node=1 -m nsa_flex.titan.train \
    --job.config_file titan_configs/$run.toml \
    --training.dataset_path "$DATA/fineweb_sample_2800.parquet" \
    --training.steps "$STEPS" --training.local_batch_size 2 --lr_scheduler.warmup_steps 20 \
    --metrics.log_freq 10 --job.dump_folder "/tmp/runs/$run" 2>&1 \
    | grep -v "^    \|Autotune\|best_kernel\|UserWarning\|warnings.warn\|storage()" > "$OUT/$run.log"
  echo "== $run rc=${PIPESTATUS[0]}"; grep -E "step: *[0-9]+" "$OUT/$run.log" | tail -4
  f=$(find /tmp/runs/$run -name metrics.jsonl | head -1); [ -n "$f" ] && cp "$f" "$OUT/$run.metrics.jsonl"
done
