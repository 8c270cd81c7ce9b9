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
# The cold set-up steps run side by side (one phase): the Kubernetes binaries (Go builds: CPU),
# the images (pip downloads and layer writes: mostly one core and the network) and the
# lowest-versions virtualenv (uv downloads). Each writes its own log, shown when the phase ends;
# the first that fails stops the others and the run, naming it.
#
# It fails fast (docs/testing.md, "How CI fails"): right after the images are built, the image
# canary (python -m tests.harness.images canary) runs each image's entry point once, 60 s at most,
# so an image that cannot start ends the run in under a minute. Without ARGS pytest then runs in
# phases: unit + chart + integration first, then cluster + e2e with --maxfail=3 (a hung cluster
# or a broken image stops after three failures). Every pytest run prints --durations=30. pytest's
# exit 5 (no tests collected) is a failure. On exit a summary names each phase, its time and the
# phase that failed.
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
    phases+=("$current|$1|$((SECONDS - current_start))")
  fi
  current=""
}
summary() {
  local rc=$? entry name status secs
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
    IFS='|' read -r name status secs <<<"${phases[-1]}"
    echo "hack/test.sh: FAILED in phase \"$name\" (exit $rc)" >&2
  else
    echo "hack/test.sh: all phases passed"
  fi
  exit $rc
}
trap summary EXIT

# side_by_side NAME=COMMAND...: run set-up steps at once, each in its own process group and
# logging to its own file; print each log as its step ends. The first failure stops the rest
# (their whole process groups: go, buildah, uv) and fails the phase, naming the step.
running_groups=()  # process groups of side-by-side steps still running (the EXIT trap stops them)
stop_groups() {
  local pgid
  for pgid in "${running_groups[@]}"; do kill -TERM -- "-$pgid" 2>/dev/null || true; done
  running_groups=()
}
side_by_side() {
  local logs spec name pid rc i
  logs=$(mktemp -d "${TMPDIR:-/tmp}/omnistage-setup.XXXXXX")
  local -A name_of=()
  for spec in "$@"; do
    name=${spec%%=*}
    # setsid: a process group of its own (this shell has no job control), so a failure elsewhere
    # can stop the step with everything it started.
    setsid bash -c 'start=$SECONDS; rc=0; bash -c "$1" || rc=$?
      echo "$((SECONDS - start))" > "$2.secs"; exit "$rc"' step "${spec#*=}" "$logs/$name" \
      > "$logs/$name.log" 2>&1 &
    name_of[$!]=$name
    running_groups+=("$!")
    echo "    $name: started (log $logs/$name.log)"
  done
  for (( i = 0; i < $#; i++ )); do
    rc=0
    wait -n -p pid "${!name_of[@]}" || rc=$?
    name=${name_of[$pid]}
    unset "name_of[$pid]"
    running_groups=("${!name_of[@]}")
    echo "---- $name: exit $rc after $(cat "$logs/$name.secs" 2>/dev/null || echo '?')s ----"
    cat "$logs/$name.log"
    if [[ $rc -ne 0 ]]; then
      echo "hack/test.sh: set-up step \"$name\" failed (exit $rc); stopping" \
        "${name_of[*]:-nothing else}" >&2
      stop_groups
      wait 2>/dev/null || true
      return "$rc"
    fi
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

cluster=true
[[ "${OMNISTAGE_SKIP_CLUSTER:-0}" == "1" ]] && cluster=false
if [[ "$cluster" == true ]]; then
  phase "set-up side by side: Kubernetes binaries, images, lowest-versions venv"
  side_by_side "kubernetes-binaries=hack/build-k8s.sh" "images=hack/build-images.sh" \
    "lowest-versions-venv=hack/lowest-deps.sh --prepare"
  phase "image canary: each image's entry point starts (60 s limit each)"
  python3 -m tests.harness.images canary --index "$(hack/build-images.sh --print-index)"
  export OMNISTAGE_POD_MODE=image
fi

# Further checks are one `phase "NAME"` line and their command each; the summary lists them.

if [[ $# -gt 0 ]]; then
  phase "pytest $*"
  pytest_run "$@"
  exit 0
fi
phase "pytest: unit, chart, integration"
pytest_run tests/unit tests/chart tests/integration
if [[ "$cluster" == true ]]; then
  phase "pytest: cluster, e2e (--maxfail=3)"
  pytest_run tests/cluster tests/e2e --maxfail=3
else
  echo "==> OMNISTAGE_SKIP_CLUSTER=1: not running tests/cluster and tests/e2e"
fi

# The lowest declared versions of every direct dependency (uv --resolution lowest-direct, in a
# venv of its own): the unit suite and the integration files that reach each floored library
# again. Last, since it repeats tests that already passed on the main environment's versions.
phase "the lowest declared dependency versions: unit and floored integration (hack/lowest-deps.sh)"
hack/lowest-deps.sh
