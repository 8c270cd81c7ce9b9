#!/usr/bin/env bash
# The one command that runs every test suite on a fresh machine (README and .ci/run call it).
# It installs the project, builds (or reuses) the local Kubernetes binaries and the container
# images, checks that each image starts, and runs pytest; the cluster fixtures start and stop the
# control plane themselves, and the local pod runner runs every pod in its image
# (OMNISTAGE_POD_MODE=image).
#
#   ./hack/test.sh                 # every phase below, cheapest first
#   ./hack/test.sh ARGS...         # the same set-up, then ONE pytest run with ARGS (no phases)
#   OMNISTAGE_SKIP_CLUSTER=1 ./hack/test.sh -m "not cluster"   # unit, integration, chart only
#
# Work that does not wait on each other runs side by side, since most tests leave a core idle
# (waits on processes, sockets and the control plane). Without ARGS, in two phases of steps:
#   1. set-up + the first tests: the Kubernetes binaries (Go builds), the images and then their
#      canary, the lowest-versions virtualenv, and pytest on unit + integration but the few
#      marked `binaries` (they need helm or the Go module cache, and would be skipped);
#   2. pytest on e2e; pytest on the `binaries` tests, then chart + cluster (a control plane of
#      its own); both with --maxfail=3 (a hung cluster or a broken image stops after three
#      failures); and hack/lowest-deps.sh's tests (the unit suite and the integration files
#      that reach each floored library, on the lowest declared versions).
# The first pytest of each phase prints to the terminal as it goes; every other step writes its
# own log, shown when it ends. The first step that fails stops the others (SIGINT, so pytest
# tears its clusters down) and ends the run, naming the step.
#
# It fails fast (docs/testing.md, "How CI fails"): right after the images are built, the image
# canary (python -m tests.harness.images canary) runs each image's entry point once, 60 s at most,
# so an image that cannot start ends the run in under a minute. Every pytest run prints
# --durations=30. pytest's exit 5 (no tests collected) is a failure. On exit a summary names
# each phase and step, its time and the one that failed.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phases=()        # "name|status|seconds" of each finished phase, for the summary
current=""       # the phase running now
current_start=0

# phase NAME: start a phase (the previous one passed, or the run would have stopped).
phase() {
  end_phase ok
  current="$*"
  current_start=$SECONDS
  echo "==> $* (at $((SECONDS - started))s)"
}
end_phase() {
  if [[ -n "$current" ]]; then
    phases+=("$current|$1|$((SECONDS - current_start))" "${steps[@]}")
  fi
  current=""
  steps=()
}
steps=()         # "  step name|status|seconds" of the current phase's side-by-side steps
failed_step=""   # the side-by-side step that failed, if one did
summary() {
  local rc=$? entry name status secs failed_phase=$current
  trap - EXIT
  stop_groups
  if [[ $rc -ne 0 ]]; then
    end_phase "FAILED (exit $rc)"
  else
    end_phase ok
  fi
  echo "==> summary ($((SECONDS - started))s)"
  for entry in "${phases[@]}"; do
    IFS='|' read -r name status secs <<<"$entry"
    printf '  %-18s %5ss  %s\n' "$status" "$secs" "$name"
  done
  if [[ $rc -ne 0 ]]; then
    echo "hack/test.sh: FAILED in phase \"$failed_phase\"${failed_step:+, step \"$failed_step\"}" \
      "(exit $rc)" >&2
  else
    echo "hack/test.sh: all phases passed"
  fi
  exit $rc
}
trap summary EXIT

# side_by_side [--stream NAME=COMMAND] NAME=COMMAND...: run steps at once, each in a process
# group of its own. The --stream step prints to the terminal as it goes; each other step logs
# to a file, printed when the step ends (at once on failure, after the streamed step on
# success). Every step's time goes into the summary. The first failure stops the rest and fails
# the phase, naming the step.
running_groups=()  # process groups of steps still running (the EXIT trap stops them too)
stop_groups() {
  local pgid alive waited
  (( ${#running_groups[@]} )) || return 0
  # SIGINT first: pytest then runs its fixtures' teardown (control planes, pod runners).
  for pgid in "${running_groups[@]}"; do kill -INT -- "-$pgid" 2>/dev/null || true; done
  for (( waited = 0; waited < 60; waited++ )); do
    alive=0
    for pgid in "${running_groups[@]}"; do
      if kill -0 -- "-$pgid" 2>/dev/null; then alive=1; fi
    done
    (( alive )) || break
    sleep 1
  done
  for pgid in "${running_groups[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
  running_groups=()
}
# One step: its command, then its time (seconds) into $2.secs, for the summary.
step_script='start=$SECONDS; rc=0; bash -c "$1" || rc=$?
echo "$((SECONDS - start))" > "$2.secs"; exit "$rc"'
side_by_side() {
  local logs spec name pid rc i secs out err stream=""
  local -A name_of=()
  local -a done_logs=()
  logs=$(mktemp -d "${TMPDIR:-/tmp}/omnistage-steps.XXXXXX")
  if [[ ${1:-} == --stream ]]; then stream=${2%%=*}; shift; fi
  for spec in "$@"; do
    name=${spec%%=*}
    # The streamed step writes to this script's stdout and stderr themselves (reopening
    # /dev/stdout would truncate a log file), each other step to its log.
    out=1 err=2
    if [[ $name != "$stream" ]]; then exec {out}>"$logs/$name.log"; err=$out; fi
    # setsid: a process group of its own (this shell has no job control), so a failure
    # elsewhere can stop the step with everything it started. A shell without job control
    # starts background work with SIGINT ignored: env restores it, so that stop_groups' SIGINT
    # reaches pytest.
    setsid env --default-signal=INT bash -c "$step_script" step "${spec#*=}" "$logs/$name" \
      >&"$out" 2>&"$err" &
    name_of[$!]=$name
    running_groups+=("$!")
    if [[ $out == 1 ]]; then
      echo "    $name: started (output below)"
    else
      exec {out}>&-
      echo "    $name: started (log $logs/$name.log, shown when it ends)"
    fi
  done
  for (( i = 0; i < $#; i++ )); do
    rc=0
    wait -n -p pid "${!name_of[@]}" || rc=$?
    name=${name_of[$pid]}
    unset "name_of[$pid]"
    running_groups=("${!name_of[@]}")
    secs=$(cat "$logs/$name.secs" 2>/dev/null || echo "?")
    if [[ $rc -ne 0 ]]; then
      steps+=("  step $name|FAILED (exit $rc)|$secs")
      failed_step=$name
      echo  # the streamed pytest may be in the middle of a line
      if [[ $name != "$stream" ]]; then
        echo "---- $name: FAILED (exit $rc) after ${secs}s; its log: ----"
        cat "$logs/$name.log"
      fi
      echo "hack/test.sh: step \"$name\" failed (exit $rc); stopping" \
        "${name_of[*]:-nothing else}" >&2
      for pid in "${!name_of[@]}"; do steps+=("  step ${name_of[$pid]}|stopped|?"); done
      stop_groups
      wait 2>/dev/null || true
      return "$rc"
    fi
    steps+=("  step $name|ok|$secs")
    echo "    $name: passed in ${secs}s"
    [[ $name != "$stream" ]] && done_logs+=("$name")
  done
  for name in "${done_logs[@]}"; do
    echo "---- $name (passed in $(cat "$logs/$name.secs")s): its log ----"
    cat "$logs/$name.log"
  done
  rm -rf "$logs"
}

# pytest ARGS...: one pytest run; exit 5 (nothing collected) is a failure, not a pass.
pytest_run() {
  local rc=0
  python3 -m pytest --durations=30 "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests ($*): failing" >&2
  fi
  return $rc
}

phase "installing omnistage with runtime, operator and dev extras"
python3 -m pip install --quiet --disable-pip-version-check -e '.[runtime,operator,dev]'

phase "ruff"
python3 -m ruff check .

export -f pytest_run  # the steps of side_by_side run it in a shell of their own
canary='python3 -m tests.harness.images canary --index "$(hack/build-images.sh --print-index)"'

cluster=true
[[ "${OMNISTAGE_SKIP_CLUSTER:-0}" == "1" ]] && cluster=false
if [[ "$cluster" == true ]]; then
  export OMNISTAGE_POD_MODE=image
fi

# Further checks are one `phase "NAME"` line and their command each (or a step of one of the
# side_by_side calls); the summary lists them.

if [[ $# -gt 0 ]]; then
  if [[ "$cluster" == true ]]; then
    phase "set-up: Kubernetes binaries, images and their canary"
    side_by_side "kubernetes-binaries=hack/build-k8s.sh" "images=hack/build-images.sh && $canary"
  fi
  phase "pytest $*"
  pytest_run "$@"
  exit 0
fi
if [[ "$cluster" != true ]]; then
  phase "pytest: unit, chart, integration"
  pytest_run tests/unit tests/chart tests/integration
  echo "==> OMNISTAGE_SKIP_CLUSTER=1: not running tests/cluster and tests/e2e"
  phase "the lowest declared dependency versions (hack/lowest-deps.sh)"
  hack/lowest-deps.sh
  exit 0
fi
phase "set-up (binaries, images + canary, lowest-versions venv) beside pytest: unit, integration"
side_by_side --stream "pytest-unit-integration=pytest_run tests/unit tests/integration -m 'not binaries'" \
  "kubernetes-binaries=hack/build-k8s.sh" \
  "images=hack/build-images.sh && $canary" \
  "lowest-versions-venv=hack/lowest-deps.sh --prepare"
# The cluster suites mostly wait on the control plane (25-35% of the two cores here), so
# tests/cluster and tests/e2e run as two pytest sessions, each with a control plane and a pod
# runner of its own (tests/harness/cluster.py: private state dir, ports and pod range), beside
# the lowest declared versions of every direct dependency (uv --resolution lowest-direct, in a
# venv of its own): the unit suite and the integration files that reach each floored library.
phase "pytest: e2e, and chart + cluster (--maxfail=3 each), beside the lowest versions' tests"
side_by_side --stream "pytest-e2e=pytest_run tests/e2e --maxfail=3" \
  "pytest-chart-cluster=pytest_run tests/unit tests/integration -m binaries && pytest_run tests/chart tests/cluster --maxfail=3" \
  "lowest-versions=hack/lowest-deps.sh"
