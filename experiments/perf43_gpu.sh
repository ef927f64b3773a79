#!/usr/bin/env bash
# Short sequences on one GPU (one device call, ~6 min): what the shared per-step masks
# (nsa_flex.layer.StepMasks) and [compile] cudagraphs (default "auto": on for one CUDA process)
# change at short sequences.
# Usage (device machine, repo root, torchtitan wheels on PYTHONPATH):
#   bash experiments/perf43_gpu.sh OUT [STEP...]        # default: titan8k layer8k titan8koff
# DATA: the folder with fineweb_sample_2800.parquet and tiktoken_cache (default: shared/data, else
# ../shared/data); BUDGET: seconds for all steps (default 345; a step gets at most what is left).
# Steps, run in the order given (each logs, and a failing one does not stop the next):
#   titan8k    torchtitan 125M at 8k, NSA and full attention, the shipped configs' defaults
#              (tokens/s, peak memory: titan.csv)
#   layer8k    the 125M-shape layer at 8k: full_layer and nsa_layer building their own masks, then
#              nsa_layer given the step's shared masks (bench_attention.py --shared-masks): what
#              each of a model's layers saves (layers.csv, column masks = shared)
#   titan8koff torchtitan 125M at 8k, NSA with --compile.cudagraphs off (titan.csv row nsa+nocg)
#   cmpwin8k, cmpwin16k, cmpwin32k  torchtitan 125M, NSA with [nsa] recompute = "cmp_win" (memory
#              against full attention's at that length; titan.csv row nsa+cmpwin)
#   titan16k   torchtitan 125M at 16k, NSA and full attention
#   titan32k   torchtitan 125M at 32k, NSA and full attention
#   layer32k   layer8k's three rows at 32k
#   syncs      experiments/host_syncs.py at 8k: host syncs of one compiled layer step, inductor's
#              CUDA-graph skip reasons and the layer's fwd+bwd ms with and without CUDA graphs
# Back in OUT (<= 8 files): summary.txt (progress lines, result rows, where each log ended),
# titan.csv, layers.csv, host_syncs.csv, perf43.tgz (every log and CSV, re-packed after each step).
set -u
OUT=${1:?usage: perf43_gpu.sh OUT [STEP...]}; shift
STEPS=${*:-titan8k layer8k titan8koff}
BUDGET=${BUDGET:-345}
DATA=${DATA:-}
for d in shared/data ../shared/data; do [ -z "$DATA" ] && [ -f "$d/fineweb_sample_2800.parquet" ] && DATA=$d; done
mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/perf43.XXXXXX")/work; mkdir -p "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
say() { echo "[$(date +%H:%M:%S) t=${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
pack() { tar czf "$OUT/perf43.tgz.part" -C "$W/.." work && mv "$OUT/perf43.tgz.part" "$OUT/perf43.tgz"; }
left() { echo $((BUDGET - SECONDS)); }
tail_of() { say "   $1 ends:"; tail -n 3 "$1" | cut -c1-300 | tee -a "$OUT/summary.txt"; }

titan() {  # seq [extra flags] [tag]: torchtitan 125M at seq, NSA and full (or NSA alone with a tag)
  local seq=$1 extra=${2:-} tag=${3:-} cap; cap=$(left)
  [ -z "$DATA" ] && { say "skip titan $seq: no DATA folder (fineweb_sample_2800.parquet)"; return; }
  [ "$cap" -lt 60 ] && { say "skip titan $seq${tag:++$tag} (budget)"; return; }
  # one run's limit: half the budget left when both attentions run, all of it for one
  local per=$cap attns="nsa full"; [ -n "$tag" ] && attns=nsa || per=$((cap / 2))
  ATTNS=$attns NSA_EXTRA="$extra" NSA_TAG=$tag bash experiments/titan_perf_runs.sh "$W/titan" "$DATA" \
    "$seq:125M" 25 "$per" 2>&1 | tee -a "$W/titan_$seq${tag}.log" | sed "s/^/   /" | tee -a "$OUT/summary.txt"
  [ -f "$W/titan/titan.csv" ] && cp "$W/titan/titan.csv" "$OUT/titan.csv"
}

layer() {  # T: the layer bench at T, own masks (full and NSA), then NSA with the shared masks
  local T=$1 B="python experiments/bench_attention.py --configs titan_125M --stages-at 0 --item-limit 100"
  for run in "own --only full_layer,nsa_layer" "shared --only nsa_layer --shared-masks"; do
    local name=${run%% *} flags=${run#* } cap; cap=$(left)
    [ "$cap" -lt 45 ] && { say "skip layer $T $name (budget)"; continue; }
    say "layer T=$T masks=$name (cap ${cap}s)"
    # shellcheck disable=SC2086  # flags split on spaces
    timeout "$cap" $B --T "$T" $flags --out "$W/layer${T}_$name" > "$W/layer${T}_$name.log" 2>&1
    say "   rc=$?"; grep -E '^[A-Za-z0-9_]+ +T= *[0-9]+ ' "$W/layer${T}_$name.log" | tee -a "$OUT/summary.txt"
    tail_of "$W/layer${T}_$name.log"
  done
  python - "$W" "$OUT/layers.csv" <<'PY'
import csv, glob, sys
rows = [dict(r, run=p.split("/")[-2]) for p in sorted(glob.glob(sys.argv[1] + "/layer*/bench.csv"))
        for r in csv.DictReader(open(p))]
keys = list(dict.fromkeys(k for r in rows for k in r))
with open(sys.argv[2], "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys); w.writeheader(); w.writerows(rows)
PY
}

syncs() {
  local cap; cap=$(left); [ "$cap" -lt 60 ] && { say "skip syncs (budget)"; return; }
  say "syncs (cap ${cap}s)"
  timeout "$cap" python experiments/host_syncs.py --out "$W/syncs" --T 8192 --no-explain > "$W/syncs.log" 2>&1
  say "   rc=$?"; grep -E '^\[' "$W/syncs.log" | tee -a "$OUT/summary.txt"; tail_of "$W/syncs.log"
  [ -f "$W/syncs/host_syncs.csv" ] && cp "$W/syncs/host_syncs.csv" "$OUT/host_syncs.csv"
}

say "perf43: steps '$STEPS', budget ${BUDGET}s, DATA=${DATA:-none}, commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
for s in $STEPS; do
  say "== $s"
  case $s in
    titan8k) titan 8192 ;;
    titan16k) titan 16384 ;;
    titan32k) titan 32768 ;;
    titan8koff) titan 8192 "--compile.cudagraphs off" nocg ;;
    cmpwin8k|cmpwin16k|cmpwin32k) k=${s#cmpwin}; titan $(( ${k%k} * 1024 )) "--nsa.recompute cmp_win" cmpwin ;;
    layer8k) layer 8192 ;;
    layer32k) layer 32768 ;;
    syncs) syncs ;;
    *) say "unknown step $s (titan8k titan16k titan32k titan8koff cmpwin8k cmpwin16k cmpwin32k layer8k layer32k syncs)" ;;
  esac
  pack
done
say "done"
