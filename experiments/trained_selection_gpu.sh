#!/usr/bin/env bash
# Issue 24: choose the selected op's q-block layout on trained selections (experiments/NOTES.md 38,
# 39, 41, 45) and check the memory fix. Each layout x selection takes ~75 s or more (compiles
# included; unpadded layouts compile longer), TITAN=1 ~4 min more:
#   1. the GPU-marked tests of the layer and the op (TESTS=1);
#   2. the 125M-shape selected branch and layer at 32k on the trained trace and on random
#      selections, for each q-block layout ROWS[:DQ] (the op's SelectedTuning rows and dq_atomic):
#      16 = 2 positions (G=8), 32 = 4, 64 = 8; DQ 1 = dQ accumulated in the dK/dV pass (no dQ
#      kernel), 0 = not, absent = by shape (there are no padded-head layouts);
#      with PROFILE=1 (default) each run appends its kernels' times to its OUT/NAME/kernels.txt;
#   3. torchtitan 125M at 32k, NSA and full attention: tokens/s and peak memory (TITAN=1; needs
#      the torchtitan wheels on PYTHONPATH and DATA with the FineWeb sample).
#   bash experiments/trained_selection_gpu.sh OUT [DATA]
# Knobs: LAYOUTS ("16 32"), PROFILE (1), TRACE (the committed 32k trace, layer 6), TESTS (1),
#   TEST_K (a pytest -k expression selecting among the GPU tests; all of them when empty), TITAN (0).
set -uo pipefail
OUT=${1:?usage: trained_selection_gpu.sh OUT [DATA]}
DATA=${2:-../shared/data}
LAYOUTS=${LAYOUTS:-16 32}
TRACE=${TRACE:-experiments/results/quality/selection_traces/nsa_L32768.npz:6}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 330 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short ${TEST_K:+-k "$TEST_K"} \
    tests/layer/test_flex_gpu.py tests/ops/test_selected_triton.py > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.log")"
fi
for lay in $LAYOUTS; do
  IFS=: read -r rows dq <<< "$lay"
  for sel in trained random; do
    A=""; [ "$sel" = trained ] && A="--selection-trace $TRACE"
    [ "${PROFILE:-1}" = 1 ] && A="$A --profile"
    name="rows${rows}_dq${dq:-auto}_$sel"
    # shellcheck disable=SC2086
    timeout 300 $PY experiments/bench_attention.py --configs titan_125M --T 32768 --stages-at 32768 \
      --only attn_selected,full_layer,nsa_layer --sel-rows "$rows" \
      --sel-dq-atomic "${dq:-}" $A --item-limit 240 --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    echo "$name: $(grep -E '^titan_125M' "$OUT/$name.log" | tr -s ' ' | tr '\n' ';')"
  done
done
if [ "${TITAN:-0}" = 1 ]; then
  bash experiments/titan_perf_runs.sh "$OUT/titan" "$DATA" "32768:125M" 40 220 > "$OUT/titan.log" 2>&1
  tail -5 "$OUT/titan.log"
fi
