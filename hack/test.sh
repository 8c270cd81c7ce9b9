#!/usr/bin/env bash
# The one command that runs every test suite on a fresh machine (README and .ci/run call it).
# It installs the project, builds (or reuses) the local Kubernetes binaries and the container
# images, and runs pytest; the cluster fixtures start and stop the control plane themselves, and
# the local pod runner runs every pod in its image (OMNISTAGE_POD_MODE=image).
#
#   OMNISTAGE_SKIP_CLUSTER=1 ./hack/test.sh -m "not cluster"   # unit, integration, chart only
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
phase() { echo "==> $* (at $((SECONDS - started))s)"; }

phase "installing omnistage with runtime, operator and dev extras"
python3 -m pip install --quiet --disable-pip-version-check -e '.[runtime,operator,dev]'

phase "ruff"
python3 -m ruff check .

phase "the lowest declared dependency versions: unit and integration suites (hack/lowest-deps.sh)"
hack/lowest-deps.sh

if [[ "${OMNISTAGE_SKIP_CLUSTER:-0}" != "1" ]]; then
  phase "building (or reusing) the local Kubernetes control plane binaries"
  hack/build-k8s.sh
  phase "building (or reusing) the images: runtime, operator (hack/build-images.sh)"
  hack/build-images.sh
  export OMNISTAGE_POD_MODE=image
fi

phase "pytest"
set +e
python3 -m pytest "$@"
rc=$?
set -e
phase "done (pytest exit $rc)"
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
