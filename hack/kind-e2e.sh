#!/usr/bin/env bash
# Run tests/cluster and tests/e2e against a kind cluster (needs Docker). Cannot run on machines
# without a Docker engine: use hack/cluster.sh there (the pytest fixtures do that automatically).
#
#   hack/kind-e2e.sh [pytest args...]
#
# Steps: build or reuse kind (pinned in hack/versions.env), build or reuse the runtime and
# operator images with hack/build-images.sh (docker), create a cluster from the pinned node image
# (1 control plane + 2 workers labelled omnistage.io/node-pool=local, which the tests use as the
# "local" nodes that really run pods), `kind load` the images under the references the chart and
# spec.image name (ghcr.io/omnistage/...:<version>), start kwok against it with the same fake GPU
# and scale nodes as hack/cluster.sh, export KUBECONFIG (that is how the pytest fixtures select
# this cluster instead of starting their own), run pytest, then delete the cluster. tests/e2e
# installs the operator with the same chart (charts/omnistage) as on the local cluster, admission
# webhook on; kind's API server reaches it through the chart's webhook Service (the local control
# plane, which routes no Services, uses webhook.clientConfig=podIP). tests/cluster's process
# operator runs without the webhook here: kind's API server cannot call this machine's loopback.
#
# Environment:
#   OMNISTAGE_KIND_CLUSTER   cluster name (default omnistage-e2e)
#   OMNISTAGE_KEEP_KIND=1    keep the cluster afterwards (delete: kind delete cluster --name ...)
#   KIND_NODE_IMAGE          override the pinned node image
#   OMNISTAGE_TORCH_VARIANT  torch in the runtime image: cuda (default) or cpu
#   OMNISTAGE_TEST_PY_IMAGE  image for test pods that run Python (default: the images' base)
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HACK")"
image_override="${KIND_NODE_IMAGE:-}"
# shellcheck source=versions.env
source "$HACK/versions.env"
KIND_NODE_IMAGE="${image_override:-$KIND_NODE_IMAGE}"
CACHE="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"
BIN="$CACHE/bin"
NAME="${OMNISTAGE_KIND_CLUSTER:-omnistage-e2e}"
PYTHON="${PYTHON:-python3}"

log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

command -v docker >/dev/null || {
  log "docker not found: kind needs a Docker engine. Use hack/cluster.sh (docs/cluster.md)."
  exit 2
}
docker info >/dev/null 2>&1 || {
  log "docker is installed but the engine is not reachable (docker info failed)."
  exit 2
}

# kind: built once into the cache, like the other components (module mode, no replaces needed).
KIND="$BIN/kind-$KIND_VERSION"
if [[ ! -x "$KIND" ]]; then
  log "building kind $KIND_VERSION"
  tmp="$(mktemp -d)"
  CGO_ENABLED=0 GOBIN="$tmp" go install "sigs.k8s.io/kind@$KIND_VERSION"
  mkdir -p "$BIN"
  mv "$tmp/kind" "$KIND"
  rmdir "$tmp"
fi
"$HACK/build-k8s.sh" kubernetes kwok
KUBECTL="$BIN/kubectl-$K8S_VERSION"

WORK="$(mktemp -d -t omnistage-kind-XXXXXX)"
export KUBECONFIG="$WORK/kubeconfig"
KWOK_PID=""
cleanup() {
  local rc=$?
  if [[ -n "$KWOK_PID" ]]; then
    kill "$KWOK_PID" 2>/dev/null || true
    wait "$KWOK_PID" 2>/dev/null || true
  fi
  if [[ "${OMNISTAGE_KEEP_KIND:-0}" == 1 ]]; then
    log "keeping cluster $NAME (KUBECONFIG=$KUBECONFIG)"
  else
    "$KIND" delete cluster --name "$NAME" >/dev/null 2>&1 || true
    rm -rf "$WORK"
  fi
  exit $rc
}
trap cleanup EXIT INT TERM

cat >"$WORK/kind.yaml" <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
- role: control-plane
- role: worker
  labels: {omnistage.io/node-pool: local}
- role: worker
  labels: {omnistage.io/node-pool: local}
EOF
log "creating kind cluster $NAME from $KIND_NODE_IMAGE"
"$KIND" create cluster --name "$NAME" --image "$KIND_NODE_IMAGE" --config "$WORK/kind.yaml" \
  --kubeconfig "$KUBECONFIG" --wait 180s

# The same images the local pod runner runs, built (or reused) from this checkout by docker, and
# loaded under the references the chart and spec.image's default use.
log "building (or reusing) the images with hack/build-images.sh"
OMNISTAGE_BUILDER=docker "$HACK/build-images.sh"
index="$(OMNISTAGE_BUILDER=docker "$HACK/build-images.sh" --print-index)"
mapfile -t refs < <("$PYTHON" -c 'import json, sys
for ref, e in json.load(open(sys.argv[1]))["images"].items():
    if e["name"] in ("runtime", "operator"): print(ref)' "$index")
# Test pods run python3 in the images' base, under the name the local harness uses too (a tag,
# not a digest: kind load needs one).
base_ref="$("$PYTHON" -c 'import json, sys
images = json.load(open(sys.argv[1]))["images"]
print(next(r for r, e in images.items() if e["name"] == "base"))' "$index")"
docker tag "$base_ref" localhost/omnistage-base:bookworm
PY_IMAGE="${OMNISTAGE_TEST_PY_IMAGE:-localhost/omnistage-base:bookworm}"
for ref in "${refs[@]}" "$PY_IMAGE"; do
  log "kind load $ref"
  "$KIND" load docker-image "$ref" --name "$NAME" >/dev/null
done

# Fake GPU and scale nodes, driven by kwok running here against the kind API server.
"$BIN/kwok-$KWOK_VERSION" --kubeconfig="$KUBECONFIG" --config="$HACK/kwok/stages.yaml" \
  --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
  --cidr=127.192.0.0/10 --node-ip=127.0.0.1 --node-lease-duration-seconds=40 \
  >"$WORK/kwok.log" 2>&1 &
KWOK_PID=$!
"$HACK/cluster.sh" nodes-yaml | "$KUBECTL" apply -f - >/dev/null
"$KUBECTL" wait --for=condition=Ready node -l type=kwok --timeout=120s >/dev/null

log "running pytest against kind (KUBECONFIG=$KUBECONFIG)"
cd "$REPO"
set +e
OMNISTAGE_TEST_PY_IMAGE="$PY_IMAGE" "$PYTHON" -m pytest tests/cluster tests/e2e "$@"
rc=$?
set -e
exit $rc
