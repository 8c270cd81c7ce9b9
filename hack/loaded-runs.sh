#!/usr/bin/env bash
# The load-robustness check of docs/testing.md: RUNS times in a row (default 3), while two CPU
# burners occupy both cores, stopping at the first failed run, either
#   SUITE=fast  (default) the unit and integration suites (pytest; JUnit XML kept), or
#   SUITE=whole the whole ./hack/test.sh: install, ruff, images, canary, unit, chart,
#               integration, cluster, e2e and the lowest-versions phase, with its summary.
# Logs and the load average (every 30 s) go to LOG_DIR (default .loaded-runs/). Extra arguments
# go to pytest (e.g. -x). Run it on a machine with nothing else busy; in the fast mode it
# installs nothing: run README's test command (hack/test.sh) once first.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS="${RUNS:-3}"
SUITE="${SUITE:-fast}"
case "$SUITE" in fast|whole) ;; *) echo "SUITE must be fast or whole, not '$SUITE'" >&2; exit 2;; esac
LOG_DIR="${LOG_DIR:-.loaded-runs}"
rm -rf "$LOG_DIR" && mkdir -p "$LOG_DIR"
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; }
trap cleanup EXIT
python3 -c 'while True: pass' & pids+=($!)
python3 -c 'while True: pass' & pids+=($!)
( while true; do echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; sleep 30; done ) \
  > "$LOG_DIR/load.txt" & pids+=($!)
echo "commit $(git rev-parse --short HEAD), suite $SUITE, $RUNS runs, 2 burners; logs in $LOG_DIR/"
for i in $(seq 1 "$RUNS"); do
  start=$(date +%s)
  echo "run $i: started $(date +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  rc=0
  if [[ "$SUITE" == whole ]]; then
    ./hack/test.sh "$@" > "$LOG_DIR/run$i.log" 2>&1 || rc=$?
  else
    python3 -m pytest tests/unit tests/integration -q -p no:cacheprovider \
      --junitxml="$LOG_DIR/run$i.xml" "$@" > "$LOG_DIR/run$i.log" 2>&1 || rc=$?
  fi
  echo "run $i: exit $rc after $(( $(date +%s) - start )) s: $(tail -1 "$LOG_DIR/run$i.log")"
  [ "$rc" -eq 0 ] || exit "$rc"
done
