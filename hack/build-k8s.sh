#!/usr/bin/env bash
# Build (or reuse from cache) the local Kubernetes test components. Safe to call every time:
# a warm run only checks the cache. See hack/build_k8s.py and docs/cluster.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/build_k8s.py" "$@"
