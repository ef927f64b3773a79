#!/usr/bin/env bash
# Issue 24: choose the selected op's q-block size on trained selections (experiments/NOTES.md 38).
# One device call: the GPU-marked tests of the layer and the op, then the 125M-shape selected
# branch and layer at 32k on the trained trace and on random selections, for each q-block size
# (rows = positions x 16 at G=8: 16 -> 1 position, 32 -> 2, 64 -> 4, 128 -> 8).
#   bash experiments/trained_selection_gpu.sh OUT            (GPU; ~1.5 min per (rows, selection))
# Knobs: ROWS ("16 64 128"), TRACE (the committed 32k trace, layer 6), TESTS (1: run the GPU tests).
set -uo pipefail
OUT=${1:?usage: trained_selection_gpu.sh OUT}
ROWS=${ROWS:-16 64 128}
TRACE=${TRACE:-experiments/results/quality/selection_traces/nsa_L32768.npz:6}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 330 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short tests/layer/test_flex_gpu.py \
    tests/ops/test_selected_triton.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi
for rows in $ROWS; do
  for sel in trained random; do
    A=""; [ "$sel" = trained ] && A="--selection-trace $TRACE"
    # shellcheck disable=SC2086
    timeout 170 $PY experiments/bench_attention.py --configs titan_125M --T 32768 --stages-at 32768 \
      --only attn_selected,full_layer,nsa_layer --sel-rows "$rows" $A --item-limit 120 \
      --out "$OUT/rows${rows}_$sel" > "$OUT/rows${rows}_$sel.log" 2>&1
    echo "rows $rows $sel: $(grep -E '^titan_125M' "$OUT/rows${rows}_$sel.log" | tr -s ' ' | tr '\n' ';')"
  done
done
