#!/usr/bin/env bash
# Issue 4 GPU run (one H100 call, <= ~9.5 min): bench_attention.py item by item, every phase of an
# item (setup, compile+first call, timing) capped by --item-limit, timestamped start/end lines in
# the logs. 1) paper config at T=65536: the 8 stages first, then the baselines, then the layer
# (item limit 150 s); 2) T=131072, layer fwd+bwd only (memory check); 3) T=4096,16384, layer +
# baselines. Steps 2-3 run only if the budget has time left.
# Usage (device machine, repo root, torchtitan/fla wheels on PYTHONPATH):
#   [PLAN="layer64k bwd64k"] bash experiments/perf_gpu_run.sh OUT [BUDGET_S]   # e.g. OUT 560
# Only 8 files come back from the device ($OUT and its subfolders together), so OUT gets at most
# 6: summary.txt (step lines, result rows, where each log ended), bench_paper_64k.log, one CSV per
# step (STEP.csv) and perf.tgz, a tar of the work folder (kept outside OUT: every log, CSV,
# errors.log traceback, plot), re-packed after every step. 2 are left for the caller (a tee'd log).
set -u
OUT=${1:?out dir}; BUDGET=${2:-560}; mkdir -p "$OUT"
W=$(mktemp -d "${TMPDIR:-/tmp}/perf_gpu_run.XXXXXX")/work; mkdir -p "$W"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # the repo root: nsa_flex, masks
say() { echo "$@" | tee -a "$OUT/summary.txt"; }
pack() { tar czf "$OUT/perf.tgz.part" -C "$W/.." work && mv "$OUT/perf.tgz.part" "$OUT/perf.tgz"; }
step() {  # cap_s name cmd... ; the command gets --out $W/name, its output goes to $W/name.log
  local cap=$1 name=$2; shift 2
  local left=$((BUDGET - SECONDS)); [ "$left" -lt 30 ] && { say "== skip $name (budget)"; return; }
  [ "$cap" -gt "$left" ] && cap=$left
  say "== $name (cap ${cap}s, t=${SECONDS}s)"
  timeout "$cap" "$@" --out "$W/$name" > "$W/$name.log" 2>&1; say "   rc=$? t=${SECONDS}s"
  grep -E '^[A-Za-z0-9_]+ +T= *[0-9]+ ' "$W/$name.log" | tee -a "$OUT/summary.txt"  # result rows
  say "   log ends:"; tail -n 3 "$W/$name.log" | cut -c1-300 | tee -a "$OUT/summary.txt"
  [ -f "$W/$name/bench.csv" ] && cp "$W/$name/bench.csv" "$OUT/$name.csv"
  pack
}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$OUT/summary.txt"
B="python experiments/bench_attention.py --configs paper"
# Named steps, run in the order of PLAN (default: all of them, as below); each gets a cap (the
# budget left caps it further). Run 1 (session 4) did stages64k, layer128k, small4k16k: every
# 64k stage but the selected/window/gate backward, nothing of the layer (its compile exceeded the
# caps, then the flex backward autotune was fixed).
# One bench process per option set, PAR of them side by side under one timing lock (their
# compiles overlap, their GPU timings never do): run_sets NAME PAR FN SET...; FN SET OUT runs the
# bench for one set into OUT (log OUT.log). CSVs and logs in perf.tgz, result rows in summary.txt.
run_sets() {
  local name=$1 par=$2 fn=$3 i=0 o k; shift 3
  say "== $name: $# sets, $par at a time (t=${SECONDS}s)"
  for o in "$@"; do i=$((i+1))
    say "   set $i: $o"
    $fn "$o" "$W/${name}_$i" &
    while [ "$(jobs -rp | wc -l)" -ge "$par" ]; do sleep 2; done
  done; wait
  for k in $(seq 1 $i); do say "   set $k: $(grep -E '^[A-Za-z0-9_]+ +T= *[0-9]+ ' "$W/${name}_$k.log" | tr '\n' ' ' | cut -c1-400)"
    tail -n 2 "$W/${name}_$k.log" | cut -c1-200 >> "$OUT/summary.txt"; done
  pack
}
# bwdtune: kernel_options of the non-packed calls (compressed, window) at 64k
bwdtune_one() {
  timeout $((BUDGET - SECONDS - 20)) $B --T 65536 --stages-at 65536 --no-baselines \
    --modes ${TUNE_MODES:-fwd_bwd} --only attn_compressed,attn_window --item-limit 200 \
    --band-options "$1" --timing-lock "$W/timing.lock" --out "$2" > "$2.log" 2>&1
}
# packtune: "rows|json" = PACK_ROWS and the packed call's kernel_options, the selected branch
packtune_one() {
  timeout $((BUDGET - SECONDS - 20)) $B --T ${PACK_T:-65536} --stages-at ${PACK_T:-65536} \
    --no-baselines --only attn_selected --item-limit 200 --pack-rows "${1%%|*}" \
    --packed-options "${1#*|}" --timing-lock "$W/timing.lock" --out "$2" > "$2.log" 2>&1
}
run_step() {
  case $1 in
    stages64k)  step 330 bench_paper_64k $B --T 65536 --stages-at 65536 --item-limit 150 ;;
    layer64k)   step 420 layer_64k $B --T 65536 --stages-at "" --only sdpa_causal,nsa_layer \
                  --item-limit 300 ;;
    bwd64k)     step 200 stages_bwd_64k $B --T 65536 --stages-at 65536 --no-baselines \
                  --only attn_selected,attn_window,gate_out,score_topn --item-limit 120 ;;
    fla64k)     step 200 fla_64k $B --T 65536 --stages-at "" --only fla_parallel_nsa_w0 \
                  --item-limit 180 ;;
    layer128k)  step 200 bench_paper_128k $B --T 131072 --stages-at "" --no-baselines \
                  --only nsa_layer --modes fwd_bwd --item-limit 180 ;;
    fold64k)    step 460 fold_64k $B --T 65536 --stages-at 65536 \
                  --only attn_compressed,attn_selected,sdpa_causal,nsa_layer --item-limit 200 ;;
    small4k16k) step 110 bench_paper_4k_16k $B --T 4096,16384 --stages-at "" --item-limit 60 ;;
    # issue 14: correctness of the split selection / expanded compressed keys / SDPA causal
    check4k)    step 150 check_4k python -m pytest -q -m gpu tests/layer/test_flex_gpu.py ;;
    checksel)   step 90 check_sel python -m pytest -q -m gpu tests/ops/test_selected_triton.py ;;
    # issue 14, second run: layers at 64k and 16k (same process as their baselines)
    layer64k16k) step 520 layers_64k_16k $B --T 65536,16384 --stages-at 65536 --item-limit 200 \
                  --only attn_selected,sdpa_causal,full_layer,nsa_layer ;;
    # issue 14: the changed stages, the old packed selection, and the layers at 64k
    split64k)   step 480 split_64k $B --T 65536 --stages-at 65536 --item-limit 200 \
                  --only score_topn,attn_compressed,attn_selected,attn_selected_flex,sdpa_causal,full_layer,nsa_layer ;;
    # issue 14: flex tile options (kernel_options) of the non-packed calls (d_k 192: compressed,
    # window) at 64k. One process per option set (BAND_OPTIONS_SETS: ;-separated JSON dicts, the
    # first is {} = inductor's defaults), TUNE_PAR of them side by side (run_sets).
    bwdtune)    IFS=';' read -ra SETS <<< "${BAND_OPTIONS_SETS:-"{}"}"
                run_sets bwdtune "${TUNE_PAR:-3}" bwdtune_one "${SETS[@]}" ;;
    # bench processes side by side under one timing lock (their compiles overlap, their timings
    # never do). PAR_JOBS: ;-separated "name|bench_attention args" (--configs paper, --timing-lock
    # and --out are added); each job's CSV comes back as NAME.csv, its log in perf.tgz. par2: a
    # second set (PAR_JOBS2) after the first has ended (e.g. a memory check that needs the GPU alone).
    par|par2)   if [ "$1" = par ]; then IFS=';' read -ra JOBS <<< "${PAR_JOBS:?PAR_JOBS}"
                else IFS=';' read -ra JOBS <<< "${PAR_JOBS2:?PAR_JOBS2}"; fi
                say "== par: ${#JOBS[@]} jobs (t=${SECONDS}s)"
                for j in "${JOBS[@]}"; do n=${j%%|*}; say "   $n: ${j#*|}"
                  ( eval "timeout $((BUDGET - SECONDS - 15)) $B ${j#*|} --timing-lock $W/timing.lock --out $W/$n" \
                      > "$W/$n.log" 2>&1; echo "rc=$? t=${SECONDS}s" >> "$W/$n.log"
                    cp "$W/$n/bench.csv" "$OUT/$n.csv" 2>/dev/null ) &
                done; wait
                for j in "${JOBS[@]}"; do n=${j%%|*}; say "   $n:"; grep -E '^[A-Za-z0-9_]+ +T= *[0-9]+ |peak=' "$W/$n.log" | tee -a "$OUT/summary.txt"
                  tail -n 2 "$W/$n.log" | cut -c1-250 | tee -a "$OUT/summary.txt"; done
                pack ;;
    # issue 14: rows of the packed selection q block (kernel_options.PACK_ROWS) with its tiles,
    # the selected branch alone at 64k. PACK_SETS: ;-separated "rows|json" (json: packed
    # kernel_options overrides, {} for none), TUNE_PAR side by side (run_sets).
    packtune)   IFS=';' read -ra SETS <<< "${PACK_SETS:-"16|{}"}"
                run_sets packtune "${TUNE_PAR:-4}" packtune_one "${SETS[@]}" ;;
    # issue 14: the 64k stages + layers and the 16k layers in two processes side by side (one
    # timing lock: their compiles overlap, their timings never do). The 16k process has inductor /
    # Triton caches of its own (a fresh machine's first compile) and lists the kernels it compiled
    # with their finish times (kernels_16k.txt in perf.tgz).
    layers2)    say "== layers2: 64k and 16k side by side (t=${SECONDS}s)"
                ( timeout $((BUDGET - SECONDS - 20)) $B --T 65536 --stages-at 65536 --item-limit 240 \
                    --only score_topn,attn_compressed,attn_selected,attn_window,sdpa_causal,full_layer,nsa_layer \
                    --timing-lock "$W/timing.lock" --out "$W/l64" > "$W/l64.log" 2>&1 ) &
                ( mkdir -p "$W/c16"; TORCHINDUCTOR_CACHE_DIR="$W/c16/inductor" TRITON_CACHE_DIR="$W/c16/triton" \
                    TORCH_LOGS="recompiles" timeout $((BUDGET - SECONDS - 20)) $B --T 16384 --stages-at "" \
                    --item-limit 400 --only sdpa_causal,full_layer,nsa_layer --timing-lock "$W/timing.lock" \
                    --out "$W/l16" > "$W/l16.log" 2>&1
                  find "$W/c16/triton" -name '*.json' ! -name '__grp*' -printf '%T@ %p\n' | sort -n > "$W/kernels_16k.txt" ) &
                wait
                for n in l64 l16; do say "   $n:"; grep -E '^[A-Za-z0-9_]+ +T= *[0-9]+ ' "$W/$n.log" | tee -a "$OUT/summary.txt"
                  tail -n 2 "$W/$n.log" | cut -c1-250 | tee -a "$OUT/summary.txt"; done
                cat "$W/l64/bench.csv" > "$OUT/layers2.csv" 2>/dev/null; tail -n +2 "$W/l16/bench.csv" >> "$OUT/layers2.csv" 2>/dev/null
                pack ;;
    # issue 14: where the first NSA layer compile at 16k waits (> 400 s before, 64k: 57 s): the
    # layers at 16k, fresh inductor/Triton caches, every thread's stack every 20 s, the compiled kernels
    # with their finish times, dynamo recompiles. Background: the next steps start at once.
    compile16k) say "== compile16k (background, t=${SECONDS}s)"; mkdir -p "$W/c16"
                ( TORCHINDUCTOR_CACHE_DIR=/tmp/c16cache/inductor TRITON_CACHE_DIR=/tmp/c16cache/triton \
                    TORCH_LOGS="recompiles" timeout $((BUDGET - SECONDS - 20)) python \
                    experiments/with_stack_samples.py 20 "$W/c16/stacks.txt" experiments/bench_attention.py \
                    --configs paper --T 16384 --stages-at "" --only sdpa_causal,full_layer,nsa_layer \
                    --item-limit 500 --timing-lock "$W/timing.lock" --out "$W/c16/bench" > "$W/c16/c16.log" 2>&1
                  echo "rc=$?" >> "$W/c16/c16.log"; cp "$W/c16/bench/bench.csv" "$OUT/compile16k.csv" 2>/dev/null
                  find /tmp/c16cache/triton -name '*.json' ! -name '__grp*' -printf '%T@ %s %p\n' | sort -n > "$W/c16/kernels.txt"
                  find /tmp/c16cache/inductor -name '*.py' -printf '%T@ %s %p\n' | sort -n > "$W/c16/inductor_py.txt"
                  say "   compile16k: $(grep -E '^[A-Za-z0-9_]+ +T= *[0-9]+ |rc=' "$W/c16/c16.log" | tr '\n' ' ')"
                  pack ) & ;;
    # issue 16 item 3: whole-model generation, 125M, 32k prompt, batch 1 and 8 (generate.csv)
    generate32k) step 400 generate_32k python experiments/bench_generate.py --flavor 125M \
                  --context 32768 --batches 1,8 ${GEN_ARGS:-} ;;
    # issue 14: the layer table (layer.csv) at the other lengths
    layers)     step 560 layers $B --T ${LAYER_T:-8192,16384,32768,131072} --stages-at "" \
                  --only sdpa_causal,flex_causal,fla_parallel_nsa_w0,full_layer,nsa_layer --item-limit 150 ;;
    *) say "== unknown step $1" ;;
  esac
}
for s in ${PLAN:-stages64k layer64k bwd64k fla64k layer128k small4k16k}; do run_step "$s"; done
wait; pack
say "== done t=${SECONDS}s"
