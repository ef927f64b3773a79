#!/usr/bin/env bash
# Issue 4 GPU run (one H100 call, <= ~9.5 min): scorer CUDA tests + check, then the layer/stage
# benchmark at 64k (stages + baselines), 128k (layer: memory), 4k, and d128 at 64k if time is left.
# Usage (device machine, repo root, torchtitan/fla wheels on PYTHONPATH): bash experiments/perf_gpu_run.sh OUT [BUDGET_S]
set -u
OUT=${1:?out dir}; BUDGET=${2:-560}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() {  # cap_s name cmd...
  local cap=$1 name=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt 30 ] && { echo "== skip $name (budget)"; return; }
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name (cap ${cap}s, t=${SECONDS}s)"
  timeout "$cap" "$@" > "$OUT/$name.log" 2>&1; echo "   rc=$? t=${SECONDS}s"; tail -4 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
step 70 pytest_scorer python -m pytest -q -x tests/test_scorer_triton.py
step 100 scorer_check python experiments/scorer_check.py --out "$OUT/scorer" --T 65536 --docs 0 --no-sweep --no-layer
step 300 bench_paper_64k python experiments/bench_attention.py --configs paper --T 65536 --stages-at 65536 --out "$OUT/bench_paper_64k"
step 110 bench_paper_128k python experiments/bench_attention.py --configs paper --T 131072 --stages-at "" --no-baselines --out "$OUT/bench_paper_128k"
step 100 bench_paper_4k python experiments/bench_attention.py --configs paper --T 4096 --stages-at "" --out "$OUT/bench_paper_4k"
step 120 bench_d128_64k python experiments/bench_attention.py --configs d128 --T 65536 --stages-at "" --out "$OUT/bench_d128_64k"
echo "== done t=${SECONDS}s"
