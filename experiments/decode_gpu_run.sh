#!/usr/bin/env bash
# Issue 16 GPU run (one H100 call, <= ~9 min), repo root:
#   bash experiments/decode_gpu_run.sh OUT
# 1) the decode GPU tests (prefill + decode == forward for both backends; the Triton step against
#    the torch step at the paper's head dims; CUDA-graph replays of the Triton step bit-equal to
#    its eager output): tests/inference/test_decode_gpu.py;
#    bench_decode.py at 64k and 128k, batch 1 and 16, CUDA graphs only, with the per-kernel
#    breakdown;
# 2) the interpreter test cases on the GPU, compiled kernels, against the torch step
#    (tests/ops/test_decode_triton.py --gpu).
# Each step is capped by `timeout` (BENCH_CAP, CASES_CAP seconds; CONTEXTS, BATCHES override the
# grid). OUT gets at most 6 files: summary.txt (check lines, result rows, where each log ended),
# bench.log, bench_decode.csv, decode_breakdown.csv, bench_decode.png, gpu_cases.log.
set -u
OUT=${1:?usage: decode_gpu_run.sh OUT}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd); cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
BENCH_CAP=${BENCH_CAP:-360}; CASES_CAP=${CASES_CAP:-170}
CONTEXTS=${CONTEXTS:-65536,131072}; BATCHES=${BATCHES:-1,16}
say() { echo "$@" | tee -a "$OUT/summary.txt"; }
say "== $(date +%T) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -1)"
say "   $($PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  2>&1 | tail -1)"

say "== decode GPU tests (t=${SECONDS}s)"
timeout "$CASES_CAP" $PY -m pytest -q -m gpu tests/inference/test_decode_gpu.py 2>&1 | tail -n 5 \
  | tee -a "$OUT/summary.txt"
say "== bench_decode (cap ${BENCH_CAP}s, t=${SECONDS}s)"
timeout "$BENCH_CAP" $PY experiments/bench_decode.py --contexts "$CONTEXTS" --batches "$BATCHES" \
  --no-eager --breakdown --out "$OUT" > "$OUT/bench.log" 2>&1
say "   rc=$? t=${SECONDS}s"
grep -E '^check |^ +S= +[0-9]+ B=|FAILED|ERROR|breakdown nsa_triton' "$OUT/bench.log" \
  | cut -c1-400 | tee -a "$OUT/summary.txt"
say "   log ends:"; tail -n 3 "$OUT/bench.log" | cut -c1-300 | tee -a "$OUT/summary.txt"

say "== decode cases on the GPU (cap ${CASES_CAP}s, t=${SECONDS}s)"
timeout "$CASES_CAP" $PY tests/ops/test_decode_triton.py --gpu > "$OUT/gpu_cases.log" 2>&1
say "   rc=$? t=${SECONDS}s"
grep -E '^FAIL|^gpu cases' "$OUT/gpu_cases.log" | head -30 | cut -c1-300 | tee -a "$OUT/summary.txt"
say "   $(grep -c '^PASS' "$OUT/gpu_cases.log") PASS lines; log ends:"
tail -n 2 "$OUT/gpu_cases.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
say "== done t=${SECONDS}s"
