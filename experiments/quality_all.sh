#!/usr/bin/env bash
# The three quality variants side by side on one GPU, one process each (experiments/quality_runs.sh
# does one segment of one variant: train, then the evaluations); each line of output is prefixed with
# its variant. Repeat the same command until every variant prints DONE.
#   bash experiments/quality_all.sh OUT DATA [EXPORT]      (the same knobs as quality_runs.sh)
#   python experiments/quality_report.py OUT
# Side by side, the three share the GPU: together they take about as long as one after the other,
# but each segment compiles once for all three and a segment boundary costs one restart, not three.
# 125M at 16k x 2 takes 18-21 GiB a run, ~60 GiB for the three: other GPU work beside them can run
# the GPU out of memory.
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: quality_all.sh OUT DATA [EXPORT]" >&2; exit 2; }
HERE=$(cd "$(dirname "$0")" && pwd)
rcs=0
for v in ${VARIANTS:-sliding_only full_causal nsa}; do
  bash "$HERE/quality_runs.sh" "$v" "$@" 2>&1 | sed -u "s/^/[$v] /" &
done
for job in $(jobs -p); do wait "$job" || rcs=1; done
exit $rcs
