#!/usr/bin/env bash
# The time limit of a training run through the trainer's halt file (nsa_flex.titan.trainer: every
# rank stops after the step it is in, saves a full checkpoint, exit 4), not a signal:
#   bash experiments/halt_after.sh SECONDS PID HALT_FILE [HALT_FILE ...] &
# After SECONDS, where process PID still runs, writes each HALT_FILE (its folder made; a curriculum
# has one a phase: <dump>/short/HALT and <dump>/HALT) and prints which. A SIGTERM to this script
# ends it at once without writing (the run ended first). The caller's `timeout` stays the backstop.
set -u
SECS=${1:?usage: halt_after.sh SECONDS PID HALT_FILE...}
PID=${2:?usage: halt_after.sh SECONDS PID HALT_FILE...}
shift 2
[ $# -ge 1 ] || { echo "usage: halt_after.sh SECONDS PID HALT_FILE..." >&2; exit 2; }
trap 'kill "$sp" 2>/dev/null; exit 0' TERM
sleep "$SECS" & sp=$!
wait "$sp"
kill -0 "$PID" 2>/dev/null || exit 0
for f in "$@"; do
  mkdir -p "$(dirname "$f")" && touch "$f" && echo "time limit: halt file $f written"
done
