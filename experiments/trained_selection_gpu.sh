#!/usr/bin/env bash
# Issue 24: choose the selected op's q-block layout on trained selections (experiments/NOTES.md 38,
# 39, 41) and check the memory fix. One device call (~9 min with TITAN=1):
#   1. the GPU-marked tests of the layer and the op (TESTS=1);
#   2. the 125M-shape selected branch and layer at 32k on the trained trace and on random
#      selections, for each q-block layout ROWS:PAD (rows, PAD_HEADS): 16:1 = today (one position,
#      G=8 padded to 16 rows), 16:0 = 2 positions unpadded, 32:0 = 4, 64:0 = 8, 128:1 = 8 padded;
#   3. torchtitan 125M at 32k, NSA and full attention: tokens/s and peak memory (TITAN=1; needs
#      the torchtitan wheels on PYTHONPATH and DATA with the FineWeb sample).
#   bash experiments/trained_selection_gpu.sh OUT [DATA]
# Knobs: LAYOUTS ("16:1 16:0 32:0 64:0"), TRACE (the committed 32k trace, layer 6), TESTS (1),
#   TEST_K (a pytest -k expression selecting among the GPU tests; all of them when empty), TITAN (0).
set -uo pipefail
OUT=${1:?usage: trained_selection_gpu.sh OUT [DATA]}
DATA=${2:-../shared/data}
LAYOUTS=${LAYOUTS:-16:1 16:0 32:0 64:0}
TRACE=${TRACE:-experiments/results/quality/selection_traces/nsa_L32768.npz:6}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 330 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short ${TEST_K:+-k "$TEST_K"} \
    tests/layer/test_flex_gpu.py tests/ops/test_selected_triton.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi
for lay in $LAYOUTS; do
  rows=${lay%:*} pad=${lay#*:}
  for sel in trained random; do
    A=""; [ "$sel" = trained ] && A="--selection-trace $TRACE"
    name="rows${rows}_pad${pad}_$sel"
    # shellcheck disable=SC2086
    timeout 170 $PY experiments/bench_attention.py --configs titan_125M --T 32768 --stages-at 32768 \
      --only attn_selected,full_layer,nsa_layer --sel-rows "$rows" --sel-pad-heads "$pad" $A \
      --item-limit 120 --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    echo "$name: $(grep -E '^titan_125M' "$OUT/$name.log" | tr -s ' ' | tr '\n' ';')"
  done
done
if [ "${TITAN:-0}" = 1 ]; then
  bash experiments/titan_perf_runs.sh "$OUT/titan" "$DATA" "32768:125M" 40 220 > "$OUT/titan.log" 2>&1
  tail -5 "$OUT/titan.log"
fi
