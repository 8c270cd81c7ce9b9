#!/usr/bin/env bash
# Local Kubernetes control plane for tests, run as plain processes (no Docker):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, built by hack/build-k8s.sh.
#
#   hack/cluster.sh up [--podrunner]   start (idempotent); --podrunner also runs the local pod runner
#                                      (in image mode when the images are built, see below)
#   hack/cluster.sh down [--purge]     stop everything started, by pid; --purge deletes the state dir
#   hack/cluster.sh env                print 'export KUBECONFIG=... PATH=...' for eval
#   hack/cluster.sh status             show component pids and /readyz
#   hack/cluster.sh nodes-yaml         print the fake kwok node manifests (hack/kind-e2e.sh uses them)
#
# Environment:
#   OMNISTAGE_CACHE        build cache (default ~/.cache/omnistage)
#   OMNISTAGE_CLUSTER_DIR  state dir: pki, kubeconfigs, etcd data, logs (logs/audit.log: what
#                          service accounts did), pids
#                          (default $OMNISTAGE_CACHE/cluster)
#   OMNISTAGE_PORT_BASE    first of 6 loopback ports (default 26440): apiserver, etcd client,
#                          etcd peer, controller-manager, scheduler, kwok
#   OMNISTAGE_GPU_NODES    kwok GPU nodes (default 4, 8 x nvidia.com/gpu each)
#   OMNISTAGE_SCALE_NODES  kwok scale nodes without GPUs (default 4, 250 pods each)
#   OMNISTAGE_POD_CIDR     pod IPs of the local pod runner (default: a /20 of 127.128.0.0/10
#                          derived from OMNISTAGE_PORT_BASE, so two clusters on one host never
#                          give pods the same IP; tests/harness/podrunner.py cluster_pod_cidr)
#   OMNISTAGE_POD_MODE     how `up --podrunner` runs pods: image (each in its image, as built by
#                          hack/build-images.sh; needs root), process (the checkout's Python, the
#                          image ignored), or unset: image when the images are built, else process
#                          with a notice
#   OMNISTAGE_IMAGE_INDEX  the image index of image mode (default: this checkout's,
#                          `hack/build-images.sh --print-index`)
#   OMNISTAGE_APISERVER_PROFILING  true: the API server serves /debug/pprof to cluster
#                          admins (default false), for a CPU profile of a benchmark's ramp
#   OMNISTAGE_KCM_CONTROLLERS  kube-controller-manager's --controllers (default '*'). Pod IPs
#                          here are loopback, which Endpoints and EndpointSlices refuse: their
#                          controllers retry every Service's update for good, with an Event
#                          each time. bench_operator_scale.py turns them off
#                          ('*,-endpoints-controller,-endpointslice-controller')
#
# Everything listens on 127.0.0.1 only. Pod IPs are loopback (kwok: 127.192.0.0/10; the local pod
# runner: a /20 of 127.128.0.0/10 per cluster) and the service range (198.18.0.0/16, RFC 2544
# benchmarking space) is never connected to.
set -euo pipefail

HACK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HACK")"
# shellcheck source=versions.env
source "$HACK/versions.env"
CACHE="${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}"
BIN="$CACHE/bin"
STATE="${OMNISTAGE_CLUSTER_DIR:-$CACHE/cluster}"
PKI="$STATE/pki"
LOGS="$STATE/logs"
PIDS="$STATE/pids"
BASE="${OMNISTAGE_PORT_BASE:-26440}"
API_PORT=$((BASE + 0))
ETCD_PORT=$((BASE + 1))
ETCD_PEER_PORT=$((BASE + 2))
KCM_PORT=$((BASE + 3))
SCHED_PORT=$((BASE + 4))
KWOK_PORT=$((BASE + 5))
GPU_NODES="${OMNISTAGE_GPU_NODES:-4}"
SCALE_NODES="${OMNISTAGE_SCALE_NODES:-4}"
SERVICE_CIDR="198.18.0.0/16"
KWOK_POD_CIDR="127.192.0.0/10"
KUBECONFIG_ADMIN="$STATE/admin.kubeconfig"
KUBECTL="$BIN/kubectl-$K8S_VERSION"
PYTHON="${PYTHON:-python3}"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok podrunner)

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

# pid of a running component we started, or nothing. The cmdline check guards against pid reuse.
running_pid() {
  local name=$1 pid
  [[ -f "$PIDS/$name.pid" ]] || return 0
  pid="$(cat "$PIDS/$name.pid")"
  if [[ -r "/proc/$pid/cmdline" ]] && tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "$STATE"; then
    echo "$pid"
  fi
}

fail_with_log() {
  local name=$1
  log "$name failed to become healthy; last lines of $LOGS/$name.log:"
  tail -n 40 "$LOGS/$name.log" >&2 || true
  exit 1
}

# wait_for NAME SECONDS CMD...: poll CMD until it succeeds; on timeout or exit show NAME's log.
wait_for() {
  local name=$1 timeout=$2 deadline
  shift 2
  deadline=$((SECONDS + timeout))
  until "$@" >/dev/null 2>&1; do
    # Right after start the forked child may not have exec'd yet (its command line does not
    # name the state dir), so "not running" must be seen twice before it counts.
    if [[ -z "$(running_pid "$name")" ]]; then
      sleep 0.3
      [[ -n "$(running_pid "$name")" ]] || "$@" >/dev/null 2>&1 || fail_with_log "$name"
    fi
    ((SECONDS < deadline)) || fail_with_log "$name"
    sleep 0.3
  done
}

# start NAME CMD...: run CMD in its own session (so 'down' can kill the whole group), log to a file.
start() {
  local name=$1
  shift
  if [[ -n "$(running_pid "$name")" ]]; then
    log "$name already running (pid $(running_pid "$name"))"
    return 0
  fi
  log "starting $name"
  printf '=== %s cluster.sh: starting %s\n' "$(date -u +%FT%TZ)" "$name" >>"$LOGS/$name.log"
  # The state dir is on every command line (see running_pid); OMNISTAGE_CLUSTER_DIR marks it too.
  OMNISTAGE_CLUSTER_DIR="$STATE" setsid "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  echo $! >"$PIDS/$name.pid"
}

gen_cert() { # gen_cert NAME SUBJECT EXTENSIONS
  local name=$1 subj=$2 ext=$3
  openssl req -new -newkey rsa:2048 -nodes -keyout "$PKI/$name.key" -out "$PKI/$name.csr" \
    -subj "$subj" 2>/dev/null
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 3650 -out "$PKI/$name.crt" \
    -extfile <(printf '%s\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n' "$ext") \
    2>/dev/null
  rm -f "$PKI/$name.csr"
}

write_kubeconfig() { # write_kubeconfig FILE CERTNAME
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: omnistage-local
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $2
  user:
    client-certificate: $PKI/$2.crt
    client-key: $PKI/$2.key
contexts:
- name: omnistage-local
  context: {cluster: omnistage-local, user: $2}
current-context: omnistage-local
EOF
}

ensure_pki() {
  [[ -f "$PKI/done" ]] && return 0
  log "generating certificates and service-account keys in $PKI"
  mkdir -p "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -keyout "$PKI/ca.key" -out "$PKI/ca.crt" \
    -subj "/CN=omnistage-local-ca" -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
  local client="keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth"
  gen_cert apiserver "/CN=kube-apiserver" "keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  gen_cert admin "/O=system:masters/CN=omnistage-admin" "$client"
  gen_cert kube-controller-manager "/CN=system:kube-controller-manager" "$client"
  gen_cert kube-scheduler "/CN=system:kube-scheduler" "$client"
  gen_cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "$client"
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  touch "$PKI/done"
}

api_ready() { "$KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" get --raw /readyz; }

nodes_yaml() {
  local i
  for ((i = 0; i < GPU_NODES; i++)); do
    node_yaml "kwok-gpu-$i" kwok-gpu 8 110
  done
  for ((i = 0; i < SCALE_NODES; i++)); do
    node_yaml "kwok-scale-$i" kwok-scale 0 250
  done
}

node_yaml() { # node_yaml NAME POOL GPUS MAXPODS -- a kwok-managed fake node
  cat <<EOF
---
apiVersion: v1
kind: Node
metadata:
  name: $1
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: $1
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    omnistage.io/node-pool: $2
    nvidia.com/gpu.present: "$([[ $3 -gt 0 ]] && echo true || echo false)"
spec:
  taints:
  - {key: kwok.x-k8s.io/node, value: fake, effect: NoSchedule}
status:
  capacity: {cpu: "64", memory: 512Gi, pods: "$4", nvidia.com/gpu: "$3"}
  allocatable: {cpu: "64", memory: 512Gi, pods: "$4", nvidia.com/gpu: "$3"}
EOF
}

cmd_up() {
  local with_podrunner=false
  [[ "${1:-}" == "--podrunner" ]] && with_podrunner=true
  "$HACK/build-k8s.sh" kubernetes etcd kwok
  mkdir -p "$STATE" "$LOGS" "$PIDS" "$STATE/etcd" "$STATE/apiserver"
  chmod 700 "$STATE/etcd"
  ensure_pki
  write_kubeconfig "$KUBECONFIG_ADMIN" admin
  write_kubeconfig "$STATE/kube-controller-manager.kubeconfig" kube-controller-manager
  write_kubeconfig "$STATE/kube-scheduler.kubeconfig" kube-scheduler
  # Audit what service accounts do (verb, resource, response code; no bodies): the chart's RBAC
  # test reads it to find 403s and granted verbs the operator never uses.
  cat >"$STATE/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts"]
- level: None
EOF

  # Static bearer tokens of the user omnistage-token-user, who has no rights until a test binds
  # some: tests/cluster/test_exec_credentials.py hands them out through an exec plugin.
  if [[ ! -f "$STATE/tokens.csv" ]]; then
    (umask 077 && for _ in 1 2 3; do
      printf '%s,omnistage-token-user,omnistage-token-user\n' "$(openssl rand -hex 16)"
    done >"$STATE/tokens.csv")
  fi

  start etcd "$BIN/etcd-$ETCD_VERSION" --name=omnistage --data-dir="$STATE/etcd" \
    --listen-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls="http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls="http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster="omnistage=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync --quota-backend-bytes=4294967296 --log-level=warn
  wait_for etcd 30 curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  start kube-apiserver "$BIN/kube-apiserver-$K8S_VERSION" \
    --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --secure-port="$API_PORT" --advertise-address=127.0.0.1 \
    --cert-dir="$STATE/apiserver" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --client-ca-file="$PKI/ca.crt" --token-auth-file="$STATE/tokens.csv" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$PKI/apiserver-kubelet-client.key" \
    --authorization-mode=Node,RBAC --anonymous-auth=false \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$PKI/sa.pub" \
    --service-account-signing-key-file="$PKI/sa.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --endpoint-reconciler-type=none \
    --allow-privileged=true --profiling="${OMNISTAGE_APISERVER_PROFILING:-false}" --event-ttl=30m \
    --max-requests-inflight=1000 --max-mutating-requests-inflight=500 \
    --audit-policy-file="$STATE/audit-policy.yaml" --audit-log-path="$LOGS/audit.log" \
    --audit-log-maxsize=200 --audit-log-maxbackup=1
  wait_for kube-apiserver 90 api_ready

  start kube-controller-manager "$BIN/kube-controller-manager-$K8S_VERSION" \
    --kubeconfig="$STATE/kube-controller-manager.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$KCM_PORT" --cert-dir="$STATE/kcm" \
    --leader-elect=false --cluster-name=omnistage \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --service-cluster-ip-range="$SERVICE_CIDR" \
    --kube-api-qps=200 --kube-api-burst=400 --concurrent-gc-syncs=20 \
    --node-monitor-grace-period=40s --profiling=false \
    --controllers="${OMNISTAGE_KCM_CONTROLLERS:-*}"
  start kube-scheduler "$BIN/kube-scheduler-$K8S_VERSION" \
    --kubeconfig="$STATE/kube-scheduler.kubeconfig" \
    --bind-address=127.0.0.1 --secure-port="$SCHED_PORT" --cert-dir="$STATE/scheduler" \
    --leader-elect=false --kube-api-qps=200 --kube-api-burst=400 --profiling=false
  wait_for kube-controller-manager 60 curl -skf "https://127.0.0.1:$KCM_PORT/healthz"
  wait_for kube-scheduler 60 curl -skf "https://127.0.0.1:$SCHED_PORT/healthz"

  start kwok "$BIN/kwok-$KWOK_VERSION" --kubeconfig="$KUBECONFIG_ADMIN" \
    --config="$HACK/kwok/stages.yaml" \
    --manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
    --cidr="$KWOK_POD_CIDR" --node-ip=127.0.0.1 --node-lease-duration-seconds=40 \
    --server-address="127.0.0.1:$KWOK_PORT"
  wait_for kwok 30 curl -sf "http://127.0.0.1:$KWOK_PORT/healthz"

  # Marker read by tests/harness: this cluster has no kubelets, so the local pod runner is needed.
  "$KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" -n kube-system create configmap \
    omnistage-local-cluster --from-literal=runtime=omnistage-podrunner \
    --dry-run=client -o yaml | "$KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" apply -f - >/dev/null
  nodes_yaml | "$KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" apply -f - >/dev/null
  if [[ "$with_podrunner" == true ]]; then
    local pod_cidr images images_arg=()
    pod_cidr="${OMNISTAGE_POD_CIDR:-}"
    if [[ -z "$pod_cidr" ]]; then
      pod_cidr="$(PYTHONPATH="$REPO" "$PYTHON" -c \
        "from tests.harness.podrunner import cluster_pod_cidr; print(cluster_pod_cidr($BASE))")"
    fi
    images="$(podrunner_images)"
    [[ -n "$images" ]] && images_arg=(--images="$images")
    if [[ -n "$images" ]]; then
      log "pod runner: pod IPs from $pod_cidr; pods run in their images ($images)"
    else
      log "pod runner: pod IPs from $pod_cidr; pods run in process mode"
    fi
    start podrunner env -u OMNISTAGE_IMAGE_INDEX PYTHONPATH="$REPO" "$PYTHON" \
      -m tests.harness.podrunner --kubeconfig="$KUBECONFIG_ADMIN" --state-dir="$STATE/podrunner" \
      --nodes=local-0,local-1 --pod-cidr="$pod_cidr" "${images_arg[@]}"
  fi
  local want=$((GPU_NODES + SCALE_NODES))
  wait_for kwok 60 kwok_nodes_ready "$want"
  if [[ "$with_podrunner" == true ]]; then
    wait_for podrunner 30 "$KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" wait --for=condition=Ready \
      node/local-0 node/local-1 --timeout=1s
  fi
  api_ready >/dev/null || fail_with_log kube-apiserver
  log "cluster up: $GPU_NODES GPU + $SCALE_NODES scale kwok nodes; run: eval \"\$($0 env)\""
}

# podrunner_images: the image index `up --podrunner` runs pods from (image mode), or nothing
# (process mode). OMNISTAGE_POD_MODE decides; unset, image mode when the images are built.
podrunner_images() {
  local mode="${OMNISTAGE_POD_MODE:-}" index why
  case "$mode" in
  "" | image | process) ;;
  *) die "OMNISTAGE_POD_MODE must be image or process, not '$mode'" ;;
  esac
  [[ "$mode" == process ]] && return 0
  index="${OMNISTAGE_IMAGE_INDEX:-}"
  [[ -n "$index" ]] || index="$("$HACK/build-images.sh" --print-index)"
  if [[ ! -f "$index" ]]; then
    why="no image index at $index (build the images: hack/build-images.sh)"
  elif [[ $EUID -ne 0 ]]; then
    why="image mode needs root (overlay mounts in private mount namespaces)"
  else
    echo "$index"
    return 0
  fi
  [[ "$mode" == image ]] && die "OMNISTAGE_POD_MODE=image: $why"
  log "NOTICE: the pod runner runs pods in process mode (the checkout's Python): $why"
}

kwok_nodes_ready() {
  local n
  n="$("$KUBECTL" --kubeconfig="$KUBECONFIG_ADMIN" get nodes -l type=kwok \
    -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
    grep -c True)"
  ((n >= $1))
}

stop_pid() { # stop_pid NAME: SIGTERM the process group, SIGKILL after 15s
  local name=$1 pid i
  pid="$(running_pid "$name")"
  if [[ -n "$pid" ]]; then
    log "stopping $name (pid $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
      [[ -n "$(running_pid "$name")" ]] || break
      sleep 0.1
    done
    if [[ -n "$(running_pid "$name")" ]]; then
      log "$name did not exit on SIGTERM; sending SIGKILL"
      kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
  fi
  rm -f "$PIDS/$name.pid"
}

cmd_down() {
  local i
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do
    stop_pid "${COMPONENTS[i]}"
  done
  if [[ "${1:-}" == "--purge" ]]; then
    log "removing $STATE"
    rm -rf "$STATE"
  fi
}

cmd_env() {
  echo "export KUBECONFIG='$KUBECONFIG_ADMIN'"
  echo "export PATH='$BIN':\"\$PATH\""
}

cmd_status() {
  local name pid rc=0
  for name in "${COMPONENTS[@]}"; do
    pid="$(running_pid "$name")"
    if [[ -n "$pid" ]]; then
      printf '%-24s running (pid %s)\n' "$name" "$pid"
    else
      printf '%-24s stopped\n' "$name"
    fi
  done
  if [[ -x "$KUBECTL" && -f "$KUBECONFIG_ADMIN" ]] && api_ready >/dev/null 2>&1; then
    echo "readyz                   ok (https://127.0.0.1:$API_PORT)"
  else
    echo "readyz                   unreachable"
    rc=1
  fi
  return $rc
}

case "${1:-}" in
up) cmd_up "${@:2}" ;;
down) cmd_down "${@:2}" ;;
env) cmd_env ;;
status) cmd_status ;;
nodes-yaml) nodes_yaml ;;
*)
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
  exit 2
  ;;
esac
