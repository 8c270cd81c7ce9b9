#!/usr/bin/env bash
# The one command that runs every test suite on a fresh machine (README and .ci/run call it).
# It installs the project, builds (or reuses) the local Kubernetes binaries, and runs pytest;
# the cluster fixtures start and stop the control plane themselves.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "==> installing omnistage with runtime, operator and dev extras"
python3 -m pip install --quiet --disable-pip-version-check -e '.[runtime,operator,dev]'

echo "==> ruff"
python3 -m ruff check .

if [[ -x hack/build-k8s.sh && "${OMNISTAGE_SKIP_CLUSTER:-0}" != "1" ]]; then
  echo "==> building (or reusing) the local Kubernetes control plane binaries"
  hack/build-k8s.sh
fi

echo "==> pytest"
set +e
python3 -m pytest "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit $rc
