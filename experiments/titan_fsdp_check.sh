#!/usr/bin/env bash
# Issue 3, multi-GPU check: the same global batch on 1 GPU and on 2 GPUs with FSDP2
# (data_parallel_shard_degree=2) must give the same losses (|diff| <= 1e-2) over the first 20 steps.
# Run on a 2-GPU machine (nvidia-h200-x2), repo root:
#   bash experiments/titan_fsdp_check.sh OUT_DIR DATA_DIR [STEPS] [PRECISIONS]
# PRECISIONS: space-separated list of bfloat16 / float32 (the mixed_precision_param of the runs).
# Global batch 4 x seq 8192: 1 GPU local batch 4 vs 2 GPUs local batch 2. Our loader shards per
# packed sequence (sequence k -> rank k % world), so both see the same sequences per step.
# Both runs start from one seed checkpoint (torchtitan's --checkpoint.create_seed_checkpoint, made on
# one process): a model initialised under FSDP draws its weights through DTensor's RNG, which is not
# the single-device stream, so without it the runs would compare two different initialisations.
# Writes OUT/<name>.log, OUT/<name>.metrics.jsonl and OUT/fsdp_check.csv (step, losses, diff).
set -uo pipefail
OUT=${1:?out dir}; DATA=${2:?data dir}; STEPS=${3:-20}; PRECS=${4:-"bfloat16"}
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken_cache PYTHONUNBUFFERED=1
mkdir -p "$OUT"
run() {  # name ngpu local_batch precision
  local name=$1 n=$2 lb=$3 prec=$4 devs
  devs=$(seq -s, 0 $((n - 1)))
  echo "== $name: $n GPU(s), local batch $lb, params $prec ($(date +%T))"
  CUDA_VISIBLE_DEVICES=$devs timeout 280 torchrun --nproc_per_node="$n" --master_port=$((29500 + RANDOM % 1000)) \
    -m nsa_flex.titan.train --job.config_file titan_configs/nsa_125m_fineweb_edu.toml \
    --training.dataset_path "$DATA/fineweb_sample_2800.parquet" \
    --training.steps "$STEPS" --training.local_batch_size "$lb" --training.seq_len 8192 \
    --training.mixed_precision_param "$prec" \
    --parallelism.data_parallel_shard_degree "$n" \
    --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 --job.dump_folder "/tmp/fsdp/$name" \
    --checkpoint.enable --checkpoint.initial_load_path /tmp/fsdp/seed/checkpoint/step-0 \
    --checkpoint.interval 100000 --checkpoint.last_save_model_only 2>&1 \
    | grep -v "^    \|Autotune\|best_kernel\|UserWarning\|warnings.warn\|storage()" > "$OUT/$name.log"
  echo "   rc=${PIPESTATUS[0]} ($(date +%T))"; grep -E "step: *[0-9]+" "$OUT/$name.log" | tail -2
  local f; f=$(find "/tmp/fsdp/$name" -name metrics.jsonl | head -1)
  [ -n "$f" ] && cp "$f" "$OUT/$name.metrics.jsonl"
}
echo "== seed checkpoint ($(date +%T))"
rm -rf /tmp/fsdp
CUDA_VISIBLE_DEVICES=0 torchrun --nproc_per_node=1 -m nsa_flex.titan.train \
  --job.config_file titan_configs/nsa_125m_fineweb_edu.toml --job.dump_folder /tmp/fsdp/seed \
  --training.dataset_path "$DATA/fineweb_sample_2800.parquet" --parallelism.data_parallel_shard_degree 1 \
  --checkpoint.enable --checkpoint.create_seed_checkpoint > "$OUT/seed_checkpoint.log" 2>&1
rc=$?; echo "   rc=$rc $(ls /tmp/fsdp/seed/checkpoint 2>&1)"
[ "$rc" = 0 ] || { tail -5 "$OUT/seed_checkpoint.log"; exit 1; }
for prec in $PRECS; do
  run "gpu1_${prec}" 1 4 "$prec"
  run "fsdp2_${prec}" 2 2 "$prec"
done
python3 - "$OUT" $PRECS <<'PY'
import csv, json, os, sys
out, precs = sys.argv[1], sys.argv[2:]
def losses(p):
    if not os.path.exists(p):
        return {}
    return {r["step"]: r["loss_metrics/global_avg_loss"] for r in map(json.loads, open(p))
            if "loss_metrics/global_avg_loss" in r}
rows = []
for prec in precs:
    a = losses(f"{out}/gpu1_{prec}.metrics.jsonl")
    b = losses(f"{out}/fsdp2_{prec}.metrics.jsonl")
    for s in sorted(set(a) & set(b)):
        rows.append(dict(precision=prec, step=s, loss_1gpu=a[s], loss_fsdp2=b[s], abs_diff=abs(a[s] - b[s])))
    d = [r["abs_diff"] for r in rows if r["precision"] == prec]
    print(f"{prec}: {len(d)} common steps, max |loss diff| = {max(d) if d else float('nan'):.5f}",
          "PASS (<= 1e-2)" if d and max(d) <= 1e-2 else "FAIL/NO DATA")
with open(f"{out}/fsdp_check.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=["precision", "step", "loss_1gpu", "loss_fsdp2", "abs_diff"])
    w.writeheader(); w.writerows(rows)
PY
