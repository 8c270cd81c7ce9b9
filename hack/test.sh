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
  phase "building (or reusing) the local Kubernetes control plane binaries"
  hack/build-k8s.sh
  phase "building (or reusing) the images: runtime, operator (hack/build-images.sh)"
  hack/build-images.sh
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
