#!/usr/bin/env bash
# Measures CI as a fresh machine runs it, on any machine: .ci/run on a clean clone of REF with
# every cache the run fills new and empty (a Python venv with nothing installed, no pip cache,
# new Go module and build caches, a new OMNISTAGE_CACHE: binaries, image storage with the
# Debian base, uv, the lowest-versions venv, built-in models). Debian packages (buildah,
# mmdebstrap) stay as installed. Needs about 30 GB free under COLD_ROOT; removes it at the end
# unless KEEP=1.
#
#   hack/cold-ci.sh [REF] [LOG]     # default: HEAD, $COLD_ROOT.log (beside the root it removes)
set -euo pipefail
repo=$(git -C "$(dirname "$0")/.." rev-parse --show-toplevel)
ref=${1:-HEAD}
root=${COLD_ROOT:-${TMPDIR:-/tmp}/omnistage-cold-ci}
log=${2:-$root.log}
rev=$(git -C "$repo" rev-parse --verify "$ref^{commit}")
rm -rf "$root"
mkdir -p "$root"
python3 -m venv "$root/venv"
git clone -q "$repo" "$root/clone"
git -C "$root/clone" checkout -q "$rev"
export PATH=$root/venv/bin:$PATH PIP_NO_CACHE_DIR=1 OMNISTAGE_CACHE=$root/cache \
  GOPATH=$root/go GOMODCACHE=$root/go/pkg/mod GOCACHE=$root/gocache UV_CACHE_DIR=$root/cache/uv \
  XDG_CACHE_HOME=$root/xdg
echo "cold CI of ${rev:0:7}: started $(date -u +%FT%TZ); log $log"
start=$SECONDS
rc=0
(cd "$root/clone" && .ci/run) > "$log" 2>&1 || rc=$?
echo "cold CI of ${rev:0:7}: exit $rc after $((SECONDS - start)) s (ended $(date -u +%FT%TZ))"
tail -20 "$log" | sed -n '/==> summary/,$p'
# The run's clusters are down (pytest's teardown), but buildah's overlay storage keeps its
# layers mounted: unmount what is under the root (deepest first), then remove it.
if [[ ${KEEP:-0} != 1 ]]; then
  findmnt -rn -o TARGET | awk -v r="$root/" 'index($0, r) == 1' | sort -r | xargs -r umount
  rm -rf "$root"
fi
exit "$rc"
