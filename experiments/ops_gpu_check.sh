#!/usr/bin/env bash
# Issue 17, GPU check of [ops] (about 2 minutes on one H100 with debug_nsa.toml), repo root:
#   bash experiments/ops_gpu_check.sh OUT_DIR [CONFIG] [STEPS] [NPROC]
# (defaults: titan_configs/debug_nsa.toml, 40 steps, 1 process per run; NPROC=2 on a 2-GPU machine
# checks that the ranks agree on the halt step). Every run goes through torchrun -m nsa_flex.titan.train
# (the stock entry point) with the tests' custom_import module tests/titan/ops_test_data.py, in parallel
# where they are independent:
#   ref    uninterrupted STEPS steps                                            (spec nsa_flex)
#   stall  the data loader blocks at batch 3: the watchdog (limit 20 s after the first step) must
#          dump stacks + CUDA memory summary and exit with code 75                 (nsa_flex_block)
#   halt   the loader sleeps 0.15 s per batch (same data): SIGUSR1 to every rank after step 5 must
#          dump while training goes on; then OUT/halt/HALT -> checkpoint + exit 4  (nsa_flex_slow)
#   resume the same command again: must start after the halt step; its losses are compared with ref
# Prints one line per check (WATCHDOG, SIGUSR1, HALT/RESUME: PASS/FAIL ...) and writes them to
# OUT/ops_gpu_check.txt; logs in OUT/<run>.log, dump folders OUT/<run>/. Exit 0 when all pass.
# Losses: exact equality is reported as such; otherwise max |diff| (bf16/flex kernels on the GPU
# need not be bitwise deterministic), PASS up to TOL (default 1e-3).
set -uo pipefail
OUT=${1:?usage: ops_gpu_check.sh OUT_DIR [CONFIG] [STEPS] [NPROC]}
CFG=${2:-titan_configs/debug_nsa.toml}; STEPS=${3:-40}; NPROC=${4:-1}; TOL=${TOL:-1e-3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT"/{ref,stall,halt} "$OUT"/*.log
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
if [ -z "${TIKTOKEN_CACHE_DIR:-}" ] && [ -d "$ROOT/../shared/data/tiktoken_cache" ]; then
  export TIKTOKEN_CACHE_DIR="$ROOT/../shared/data/tiktoken_cache"
fi

train() {  # name spec [extra args...]: torchrun in the background, log OUT/name.log
  local name=$1 spec=$2; shift 2
  $PY -m torch.distributed.run --nproc_per_node="$NPROC" --master_port=$((20000 + RANDOM % 20000)) \
    -m nsa_flex.titan.train --job.config_file "$CFG" --job.dump_folder "$OUT/$name" \
    --training.steps "$STEPS" --metrics.log_freq 1 \
    --checkpoint.enable --checkpoint.interval 100000 --checkpoint.last_save_model_only \
    --experimental.custom_import tests.titan.ops_test_data --model.name "$spec" "$@" >> "$OUT/$name.log" 2>&1
}
last_step() { [ -f "$1/metrics.jsonl" ] && grep -o '"step": [0-9]*' "$1/metrics.jsonl" | tail -1 | grep -o '[0-9]*$' || echo 0; }
step_gt() { [ "$(last_step "$1")" -gt "$2" ]; }
dumps_ge() { [ "$(ls "$1" 2>/dev/null | wc -l)" -ge "$2" ]; }
wait_until() {  # seconds description command...: poll until the command succeeds
  local limit=$1 what=$2 t=0; shift 2
  until "$@"; do sleep 0.5; t=$((t + 1)); if [ $t -ge $((limit * 2)) ]; then echo "timeout: $what"; return 1; fi; done
}

echo "== preflight ($(date +%T))"
$PY -m nsa_flex.titan.cli --preflight --job.config_file "$CFG" --job.dump_folder "$OUT/preflight" \
  > "$OUT/preflight.log" 2>&1
PRE_RC=$?
grep -E '^\[|^preflight:' "$OUT/preflight.log"

echo "== ref, stall, halt runs ($(date +%T))"
train ref nsa_flex & REF=$!
train stall nsa_flex_block --ops.stall_timeout_s 20 --ops.stall_timeout_first_s 900 --ops.stall_exit_code 75 & STALL=$!
# the HALT run: --checkpoint.last_save_model_only (true) as in the ablation TOMLs: the halt checkpoint must still be full
train halt nsa_flex_slow & HALT=$!
wait_until 600 "halt run step 5" step_gt "$OUT/halt" 4
PIDS=$(grep -o 'ops: rank [0-9]* pid [0-9]*' "$OUT/halt.log" | awk '{print $5}' | sort -u)
echo "SIGUSR1 -> halt run ranks: $PIDS ($(date +%T))"
for p in $PIDS; do kill -USR1 "$p"; done
wait_until 30 "SIGUSR1 dumps" dumps_ge "$OUT/halt/stalls" "$NPROC"  # on failure HALT is still checked
AT=$(last_step "$OUT/halt")
wait_until 120 "a step after the dump" step_gt "$OUT/halt" "$AT"
touch "$OUT/halt/HALT"
wait $HALT; HALT_RC=$?
cp "$OUT/halt/metrics.jsonl" "$OUT/halt/metrics_before_halt.jsonl" 2>/dev/null
rm -f "$OUT/halt/metrics.jsonl"
echo "== resume ($(date +%T))"
train halt nsa_flex_slow; RESUME_RC=$?
wait $STALL; STALL_RC=$?
wait $REF; REF_RC=$?
echo "== done ($(date +%T))"

$PY - "$OUT" "$STEPS" "$NPROC" "$TOL" "$PRE_RC" "$REF_RC" "$STALL_RC" "$HALT_RC" "$RESUME_RC" <<'EOF' | tee "$OUT/ops_gpu_check.txt"
import glob, json, os, re, sys
out, steps, nproc, tol = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
pre_rc, ref_rc, stall_rc, halt_rc, resume_rc = map(int, sys.argv[5:10])
def recs(p):
    r = {}
    for line in open(p) if os.path.exists(p) else []:
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss_metrics/global_avg_loss" in d:
            r[d["step"]] = d["loss_metrics/global_avg_loss"]
    return r
ok_all = True
def report(name, ok, msg):
    global ok_all
    ok_all &= ok
    print(f"{name}: {'PASS' if ok else 'FAIL'} {msg}")
pre = open(f"{out}/preflight.log").read().strip().splitlines()
report("PREFLIGHT", pre_rc == 0, f"rc={pre_rc}; {pre[-1] if pre else 'no output'}")
dumps = sorted(glob.glob(f"{out}/stall/stalls/step-*-rank-*.txt"))
txt = open(dumps[0]).read() if dumps else ""
frame = re.search(r"innermost project frame \(main thread\): (.*)", txt)
cuda = "CUDA" in txt or "Memory Allocator" in txt or "memory (cuda)" in txt
idle = re.search(r"since the last completed step \(or start\): ([0-9.]+)", txt)
slog = open(f"{out}/stall.log").read()
code75 = stall_rc == 75 or (stall_rc != 0 and "exitcode: 75" in slog)  # torchrun exits 1, naming the worker's 75
report("WATCHDOG", code75 and len(dumps) >= nproc and "wait_for_data_forever" in txt,
       f"rc={stall_rc} (worker exit code 75: {code75}), {len(dumps)} dump(s) {dumps[:1]}, after {idle.group(1) if idle else '?'} s idle "
       f"(limit 20 s), frame: {frame.group(1) if frame else '?'}, memory: {'CUDA summary' if cuda else 'no CUDA summary'}")
sig = sorted(glob.glob(f"{out}/halt/stalls/step-*-rank-*.txt"))
before = recs(f"{out}/halt/metrics_before_halt.jsonl")
sig_step = min((int(os.path.basename(p).split("-")[1]) for p in sig), default=0)
report("SIGUSR1", len(sig) >= nproc and all("SIGUSR1" in open(p).read() for p in sig) and max(before, default=0) > sig_step,
       f"{len(sig)} dump(s) at step {sig_step} ({', '.join(os.path.basename(p) for p in sig)}); training went on to step "
       f"{max(before, default=0)} before the halt")
ref, res = recs(f"{out}/ref/metrics.jsonl"), recs(f"{out}/halt/metrics.jsonl")
n = max(before, default=0)
log = open(f"{out}/halt.log").read()
started = re.findall(r"Training starts at step (\d+)", log)
common = [s for s in range(1, steps + 1) if s in ref and (s in before or s in res)]
diffs = [abs(ref[s] - (before[s] if s <= n else res[s])) for s in common]
dmax = max(diffs, default=float("nan"))
halted = halt_rc == 4 or (halt_rc != 0 and "exitcode: 4" in log)  # a halt exits 4; torchrun exits 1 naming it
good = (halted and resume_rc == 0 and ref_rc == 0 and 0 < n < steps and sorted(res) == list(range(n + 1, steps + 1))
        and os.path.isdir(f"{out}/halt/checkpoint/step-{n}") and not os.path.exists(f"{out}/halt/HALT")
        and str(n + 1) in started and len(common) == steps and dmax <= tol)
report("HALT/RESUME", good,
       f"halt rc={halt_rc} after step {n} (checkpoint step-{n}: {os.path.isdir(f'{out}/halt/checkpoint/step-{n}')}), "
       f"resume rc={resume_rc} started at step {started[-1] if started else '?'}; steps 1..{steps} vs uninterrupted "
       f"(ref rc={ref_rc}): " + ("exact" if diffs and dmax == 0 else f"max |diff| {dmax:.3g} (tol {tol:g})"))
sys.exit(0 if ok_all else 1)
EOF
