#!/usr/bin/env bash
# Issue 24 measurements on a machine with two GPUs, as one background job that outlives a device
# call (later calls only wait and collect; experiments/NOTES.md 44): two queues of named steps,
# Q0 on GPU 0 and Q1 on GPU 1, each step into OUT/STEP/ with its log OUT/STEP.log. A step that
# finished (OUT/STEP/DONE) is skipped when the job is started again.
#   Q0="sel125 paperprof" Q1="titan32k selpaper" bash experiments/perf_x2.sh OUT DATA
# (Q1= empty on a one-GPU machine: nothing for GPU 1.)
# Steps (each capped by `timeout`):
#   sel125     selected_gpu.py at the 125M shape, 32k: check + layouts x (random, trained trace)
#   selpaper   selected_gpu.py at the paper shape, 16k, random selections
#   titan32k   torchtitan 125M at 32k, NSA and full attention: tokens/s, peak memory
#   titan8k    the same at 8k
#   titan32klean, titan32kleanwin  torchtitan 125M at 32k, NSA with cmp_kernel cudnn_lean (and
#              recompute win)
#   titan32krc torchtitan 125M at 32k, NSA with recompute = cmp_win (memory for compute)
#   paperprof  bench_attention.py, paper shape at 16k (PAPER_T=T,T..): every stage and the layer, kernel profiles
#   layers125  layer.csv rows: 125M shape at 8k and 32k, trained and random selections
#   layerspaper layer.csv rows: paper shape at 8k, 16k, 64k (random selections), fla beside
#   titan1B    torchtitan 1B at 8k and 32k (PLAN_1B, e.g. "32768:1B"), full activation
#              checkpointing for both attentions
#   prof8k     bench_attention.py, 125M shape at 8k: every stage and the layer, kernel profiles
#              (is the NSA layer bound by per-call costs there? experiments/NOTES.md 50(e))
#   memory     saved_memory.py: what the 125M-shape layer keeps for its backward at 32k: NSA with
#              recompute none / win / cmp_win, and full attention
#   gputests   the GPU-marked tests of the op and the layer (tests/ops, tests/layer)
#   gpurecompute the GPU tests of NSAConfig.recompute, the compressed flex call and the 32k compile
#   gpuops     the GPU tests of the selected op (tests/ops/test_selected_triton.py)
#   gpuflex    every GPU test of the flex backend and the layer (tests/layer/test_flex_gpu.py)
#   paper16k   bench_attention.py, paper shape at 16k: the NSA and full-attention layers with
#              kernel profiles
#   paperlayers the paper-shape layer and full attention at 8k / 16k, random and trained picks
#   cmpprobe   experiments/cmp_sdpa_probe.py (the compressed branch on SDPA's kernels vs flex)
#   cmpab      layer rows at the 125M shape (8k, 32k, trained) and the paper shape (16k) with each
#              cuDNN route of the compressed branch (cmp_kernel cudnn, cudnn_lean)
#   gpucmp     the GPU tests of the compressed branch (tests/layer/test_flex_gpu.py -k compressed)
#   gpugate    the GPU tests of the gate's mix op and the flex layer
#   tunerows   tune_selected.py: the query-centric kernels' q block rows x warps x stages, paper
#              shape at 16k (fwd and dQ) and 125M shape at 32k (fwd), random and trained picks
#   selhyb     selected_gpu.py at the paper shape, 8k / 16k, the default layout (forward on 64-row
#              blocks, hybrid dQ), random and trained picks, kernel by kernel
#   tunedq     tune_selected.py at the paper shape, 16k: the dQ pass on 16-row and on 64-row blocks
#              alone (the two halves of the hybrid)
#   gpu1b      the GPU test of the selected op at torchtitan 1B's group (G = 16, d 64)
#   memorypeak saved_memory.py --at-peak: what is live at the 125M-shape layer's fwd+bwd peak at
#              32k (NSA with recompute none / cmp_win, full attention)
#   paper64k   the paper-shape layer and full attention at 64k, random picks
#   ab125      layers125's trained rows (8k, 32k: the NSA and full-attention layers) for this tree
#              and for the tree at BASE_TREE (an unpacked `git archive` of the commit before a
#              change): the change's A/B on one machine
#   titan32kall torchtitan 125M at 32k, NSA with recompute = all (every branch rebuilt)
#   sel8k      selected_gpu.py at the 125M shape, 8k and 32k: the default layout, random and
#              trained picks, kernel by kernel (where the op's time goes at short T)
#   nofusion   layers125's trained 32k row with inductor's epilogue fusion off (what fusing the gate
#              into the window branch's flex forward costs; experiments/NOTES.md 55), profiled
#   hostprof   host_overhead.py, 125M shape at 8k (trained picks): wall against kernel time per
#              layer call, the host's time per forward / backward, its top ops, one call's trace
#   hostab     hostprof for each inductor setting in HOST_AB (default "combo_kernels=False
#              combo_kernels=True"), one machine
#   paper8kprof the paper-shape layer and full attention at 8k, trained picks, kernel profiles
#   paper64kprof the paper-shape layer and full attention at 64k, random picks, kernel profiles
#   layer1b    the torchtitan 1B attention shape (32 q / 2 KV heads, d 64) at 32k, trained picks,
#              the NSA and full-attention layers with kernel profiles
# (The torchtitan steps without inductor's combo kernels: TITAN_EXTRA="--compile.no_combo_kernels".)
# Knobs: BASE_TREE, LAYOUTS (selected_gpu.py --layouts), TRACE (NPZ:LAYER), PAPER_TRACE, PLAN_1B, PYTHON.
set -uo pipefail
OUT=${1:?usage: perf_x2.sh OUT DATA}
DATA=${2:?usage: perf_x2.sh OUT DATA}
mkdir -p "$OUT"
echo $$ > "$OUT/driver.pid"
PY=${PYTHON:-python3}
TRACE=${TRACE:-experiments/results/quality/selection_traces/nsa_L32768.npz:6}
# the paper shape's four KV heads on trained picks: two layers' two heads each, first T positions
PAPER_TRACE=${PAPER_TRACE:-experiments/results/quality/selection_traces/nsa_L32768.npz:6+11}
LAYOUTS=${LAYOUTS:-16:1,16:0,32:0}
B="$PY experiments/bench_attention.py"
progress() { echo "[$(date -u +%FT%TZ)] $*" | tee -a "$OUT/progress.txt"; }
step() {  # STEP: run it unless done
  local s=$1 o=$OUT/$1 rc
  [ -f "$o/DONE" ] && return
  mkdir -p "$o"; progress "$s: start (GPU $CUDA_VISIBLE_DEVICES)"
  case $s in
    sel125) timeout 900 $PY experiments/selected_gpu.py --out "$o" --check-shapes titan_125M \
              --check-len 1000 --shapes titan_125M:32768 --trace "$TRACE" --layouts "$LAYOUTS" ;;
    selpaper) timeout 900 $PY experiments/selected_gpu.py --out "$o" --skip-check \
              --shapes paper:16384 --layouts "${PAPER_LAYOUTS:-16:1,16:1:1,32:0:1}" ;;
    paperlayers) for sel in random trained; do A=""; [ $sel = trained ] && A="--selection-trace $PAPER_TRACE"
                 # shellcheck disable=SC2086
                 timeout 600 $B --configs paper --T 8192,16384 --stages-at 0 --item-limit 200 $A \
                   --only full_layer,nsa_layer --out "$o/$sel"; done ;;
    titan32k) bash experiments/titan_perf_runs.sh "$o" "$DATA" "32768:125M" 40 240 ;;
    titan32klean) ATTNS=nsa NSA_EXTRA="--nsa.cmp_kernel cudnn_lean" NSA_TAG=lean bash experiments/titan_perf_runs.sh \
              "$o" "$DATA" "32768:125M" 40 240 ;;
    titan32kleanwin) ATTNS=nsa NSA_EXTRA="--nsa.cmp_kernel cudnn_lean --nsa.recompute win" NSA_TAG=leanwin \
              bash experiments/titan_perf_runs.sh "$o" "$DATA" "32768:125M" 40 240 ;;
    titan8k) bash experiments/titan_perf_runs.sh "$o" "$DATA" "8192:125M" 40 240 ;;
    titan32krc) ATTNS=nsa NSA_EXTRA="--nsa.recompute cmp_win" NSA_TAG=cmpwin bash experiments/titan_perf_runs.sh \
              "$o" "$DATA" "32768:125M" 40 240 ;;
    titan1B) TITAN_EXTRA="--activation_checkpoint.mode full" bash experiments/titan_perf_runs.sh \
              "$o" "$DATA" "${PLAN_1B:-8192:1B 32768:1B}" 40 300 ;;
    prof8k) timeout 600 $B --configs titan_125M --T 8192 --stages-at 8192 --profile \
              --only projections,compression,score_topn,mask_build,attn_compressed,attn_selected,attn_window,gate_out,full_layer,nsa_layer \
              --item-limit 200 --out "$o" ;;
    paperprof) timeout 900 $B --configs paper --T ${PAPER_T:-16384} --stages-at ${PAPER_T:-16384} --no-baselines --profile \
              --only projections,compression,score_topn,mask_build,attn_compressed,attn_selected,attn_window,gate_out,nsa_layer \
              --item-limit 200 --out "$o" ;;
    layers125) for sel in random trained; do A=""; [ $sel = trained ] && A="--selection-trace $TRACE --profile"
                 # shellcheck disable=SC2086
                 timeout 600 $B --configs titan_125M --T 8192,32768 --stages-at 0 $A --item-limit 200 \
                   --only sdpa_causal,full_layer,fla_parallel_nsa_w0,nsa_layer --out "$o/$sel"; done ;;
    cmpab) for k in cudnn cudnn_lean; do  # the compressed branch's two cuDNN routes, trained selections
             timeout 600 $B --configs titan_125M --T 8192,32768 --stages-at 0 --selection-trace "$TRACE" \
               --item-limit 200 --only full_layer,nsa_layer --cmp-kernel $k --out "$o/125M_$k"
             timeout 600 $B --configs paper --T 16384 --stages-at 0 --item-limit 200 \
               --only full_layer,nsa_layer --cmp-kernel $k --out "$o/paper_$k"; done ;;
    gpugate) timeout 900 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/ops/test_gate_triton.py tests/layer/test_flex_gpu.py -k "gate or layer_flex_bf16 or every_dtype or compiles_at_32k" ;;
    layerspaper) timeout 1200 $B --configs paper --T 8192,16384,65536 --stages-at 0 --item-limit 200 \
              --only sdpa_causal,full_layer,fla_parallel_nsa_w0,nsa_layer --out "$o" ;;
    memory) timeout 600 $PY experiments/saved_memory.py --out "$o" --configs titan_125M --T 32768 \
              --recompute none,win,cmp_win ;;
    gputests) timeout 900 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/ops/test_selected_triton.py tests/layer/test_flex_gpu.py ;;
    gpurecompute) timeout 600 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/layer/test_flex_gpu.py -k "recompute or compressed or compiles_at_32k" ;;
    gpuops) timeout 600 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/ops/test_selected_triton.py ;;
    gpuflex) timeout 900 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/layer/test_flex_gpu.py ;;
    paper16k) timeout 600 $B --configs paper --T 16384 --stages-at 0 --profile --item-limit 200 \
              --only full_layer,nsa_layer --out "$o" ;;
    cmpprobe) timeout 600 $PY experiments/cmp_sdpa_probe.py --out "$o" --ops flex,cudnn,op ;;
    gpucmp) timeout 600 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/layer/test_flex_gpu.py -k "compressed or layer_flex_bf16" ;;
    tunerows) timeout 420 $PY experiments/tune_selected.py --out "$o/paper" --shape paper:64:4:192:128:16384 \
                --trace "$PAPER_TRACE" --rep-ms 100 --dkv 128:8:2 \
                --fwd 16:2:2,0:2:2,0:4:2,0:4:3,0:8:2,64:4:2,64:4:3,64:8:2,64:8:3 \
                --dq 0:2:2,0:2:1,32:2:2,32:4:2,32:4:1,32:8:2,64:4:2,64:4:1,64:8:2,64:8:1
              timeout 240 $PY experiments/tune_selected.py --out "$o/125M" --trace "$TRACE" --rep-ms 100 \
                --dkv 128:8:2 --dq none --fwd 0:2:2,0:4:2,32:2:2,32:4:2,32:4:3,64:4:2,64:8:2 ;;
    selhyb) timeout 400 $PY experiments/selected_gpu.py --out "$o" --skip-check \
              --shapes paper:8192,paper:16384 --layouts 16 --trace "$PAPER_TRACE" ;;
    tunedq) timeout 300 $PY experiments/tune_selected.py --out "$o" --shape paper:64:4:192:128:16384 \
              --trace "$PAPER_TRACE" --rep-ms 100 --dkv 128:8:2 --fwd 0:4:2 --dq 16:2:2,64:4:1 ;;
    gpu1b) timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rf --tb=short \
              tests/ops/test_selected_triton.py -k "paper_shape and 1B" ;;
    memorypeak) timeout 600 $PY experiments/saved_memory.py --out "$o" --configs titan_125M --T 32768 \
              --recompute none,cmp_win --at-peak ;;
    paper64k) timeout 600 $B --configs paper --T 65536 --stages-at 0 --item-limit 200 \
              --only full_layer,nsa_layer --out "$o" ;;
    ab125) for tree in base this; do root=.; [ $tree = base ] && root=${BASE_TREE:?ab125 needs BASE_TREE}
             (cd "$root" && PYTHONPATH="$(pwd):${PYTHONPATH:-}" timeout 400 $B --configs titan_125M \
               --T 8192,32768 --stages-at 0 --selection-trace "$TRACE" --item-limit 200 \
               --only full_layer,nsa_layer --out "$o/$tree"); done ;;
    titan32kall) ATTNS=nsa NSA_EXTRA="--nsa.recompute all" NSA_TAG=all bash experiments/titan_perf_runs.sh \
              "$o" "$DATA" "32768:125M" 40 240 ;;
    sel8k) timeout 400 $PY experiments/selected_gpu.py --out "$o" --skip-check \
              --shapes titan_125M:8192,titan_125M:32768 --layouts 16 --trace "$TRACE" ;;
    nofusion) timeout 600 $B --configs titan_125M --T 32768 --stages-at 0 --selection-trace "$TRACE" \
              --profile --item-limit 200 --only full_layer,nsa_layer --inductor epilogue_fusion=False \
              --out "$o" ;;
    hostprof) timeout 400 $PY experiments/host_overhead.py --out "$o" --configs titan_125M --T 8192 \
              --selection-trace "$TRACE" ;;
    hostab) for w in ${HOST_AB:-combo_kernels=False combo_kernels=True}; do timeout 400 $PY experiments/host_overhead.py \
              --out "$o/${w//=/_}" --configs titan_125M --T 8192 --selection-trace "$TRACE" --inductor "$w"; done ;;
    paper8kprof) timeout 600 $B --configs paper --T 8192 --stages-at 0 --item-limit 200 --profile \
              --selection-trace "$PAPER_TRACE" --only full_layer,nsa_layer --out "$o" ;;
    paper64kprof) timeout 600 $B --configs paper --T 65536 --stages-at 0 --item-limit 200 --profile \
              --only full_layer,nsa_layer --out "$o" ;;
    layer1b) timeout 400 $B --configs titan_1B --T 32768 --stages-at 0 --item-limit 200 --profile \
              --selection-trace "$TRACE" --only full_layer,nsa_layer --out "$o" ;;
    *) echo "unknown step $s"; return ;;
  esac > "$o.log" 2>&1
  rc=$?; touch "$o/DONE"; progress "$s: rc=$rc"
}
# one rendezvous port per GPU: two torchtitan runs at once must not meet on torchrun's default
queue() { local gpu=$1 s; shift; for s in "$@"; do CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$((29500 + gpu)) step "$s"; done; }
# shellcheck disable=SC2086
queue 0 ${Q0-sel125 paperprof} &
# shellcheck disable=SC2086
queue 1 ${Q1-titan32k selpaper} &
wait
touch "$OUT/ALL_DONE"; progress "all done"
