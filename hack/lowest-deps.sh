#!/usr/bin/env bash
# Proves pyproject.toml's lower bounds: installs the lowest version it allows of every direct
# dependency (uv's --resolution lowest-direct; what they pull in resolves as usual) with the
# runtime, operator and dev extras into a virtualenv of its own, and runs the unit suite and the
# integration files that reach each floored library there (FLOOR_TESTS below). A floor that is
# not true fails here, not on a user's machine.
#
#   hack/lowest-deps.sh            # unit + FLOOR_TESTS (hack/test.sh runs this)
#   LOWEST_DEPS_ALL=1 hack/lowest-deps.sh   # unit + every integration file
#   hack/lowest-deps.sh -x -q      # extra arguments go to pytest
#   hack/lowest-deps.sh --prepare  # only install (or reuse) the venv and check its floors:
#                                  # hack/test.sh does this beside its other set-up steps
#
# The virtualenv lives under ~/.cache/omnistage/lowest-venv/<hash of pyproject.toml and the
# python>, so a second run reuses it; uv's cache (~/.cache/omnistage/uv) keeps the downloads.
# The main environment is never touched: pytest runs on the venv's interpreter, and the
# checkout is installed editable into the venv, so subprocesses (sys.executable) see it too.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
started=$SECONDS
prepare_only=false
if [[ ${1:-} == --prepare ]]; then prepare_only=true; shift; fi
say() { echo "lowest-deps: $* (at $((SECONDS - started))s)"; }
trap 'say "FAILED: the command at line $LINENO (see above)" >&2' ERR

cache=${OMNISTAGE_CACHE:-$HOME/.cache/omnistage}
export UV_CACHE_DIR=${UV_CACHE_DIR:-$cache/uv}
export UV_PYTHON_DOWNLOADS=never  # the venv uses this machine's python3, never a downloaded one
python=$(command -v python3)

if ! python3 -m uv --version >/dev/null 2>&1; then
  say "installing uv from PyPI"
  python3 -m pip install --quiet --disable-pip-version-check 'uv>=0.5'
fi
uv() { python3 -m uv "$@"; }

key=$({ cat pyproject.toml; "$python" -VV; } | sha256sum | cut -c1-16)
venvs=$cache/lowest-venv
venv=$venvs/$key
marker=$venv/.omnistage-installed  # holds the checkout the venv was last installed from

# Venvs of older pyproject.tomls are dead weight (several GB each): keep only this one.
if [[ -d $venvs ]]; then
  find "$venvs" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -exec rm -rf {} +
fi

if [[ -f $marker && $(cat "$marker") == "$root" ]]; then
  say "reusing $venv"
else
  say "installing the lowest direct versions into $venv"
  rm -rf "$venv"
  uv venv --quiet --python "$python" "$venv"
  uv pip install --python "$venv/bin/python" --resolution lowest-direct \
    -e ".[runtime,operator,dev]"
  echo "$root" > "$marker"
fi

# The suites must import this checkout and the venv's packages, whatever the caller's env says.
unset PYTHONPATH PYTHONHOME
export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
# Built-in models saved by these versions, apart from the main environment's: a tokenizer that
# a newer transformers saved names classes an older one lacks.
export OMNISTAGE_CACHE=$venv/omnistage-cache
imported=$("$venv/bin/python" -c 'import omnistage, omni_operator; print(omnistage.__file__)')
if [[ $imported != "$root/"* ]]; then
  echo "lowest-deps: the venv imports omnistage from $imported, not from $root" >&2
  exit 1
fi

say "direct dependencies as installed (each must be its declared floor)"
"$venv/bin/python" - <<'EOF'
import sys
from importlib.metadata import distribution, version

from packaging.requirements import Requirement
from packaging.version import Version

# A floor the resolver could not honour (it backtracked above it) would be declared but not
# tested: that fails here, naming the package, until pyproject.toml says what is tested.
wrong, shown = [], {}
for req in map(Requirement, distribution("omnistage").requires or []):
    if req.marker and not any(req.marker.evaluate({"extra": e})
                              for e in ("", "runtime", "operator", "dev")):
        continue
    have = version(req.name)
    shown[req.name] = have
    floors = [s.version for s in req.specifier if s.operator == ">="]
    if not floors:
        wrong.append(f"{req.name}: no '>=' floor in pyproject.toml")
    elif Version(have) != Version(floors[0]):
        wrong.append(f"{req.name}: declared >={floors[0]}, resolved {have}")
print("  " + " ".join(f"{n}=={v}" for n, v in sorted(shown.items(), key=lambda i: i[0].lower())))
if wrong:
    sys.exit("lowest-deps: floors that are not what gets tested:\n  " + "\n  ".join(wrong))
EOF
say "ruff check . with ruff's floor"
"$venv/bin/ruff" check --quiet .
if [[ $prepare_only == true ]]; then
  say "prepared $venv"
  exit 0
fi

# The ML stack's floors are the main environment's own versions (docs/testing.md), so what can
# differ here is the serving and wire libraries. The unit suite reaches all of them in-process;
# these integration files add each one across real processes, sockets and clients, at a quarter
# of the whole integration suite's time:
FLOOR_TESTS=(
  tests/integration/test_worker.py      # pyzmq, msgspec, safetensors + from_pretrained, aiohttp
  tests/integration/test_http_api.py    # aiohttp's server, the openai client
  tests/integration/test_audio_api.py   # av, soundfile, numpy
  tests/integration/test_fuzz_api.py    # schemathesis, jsonschema, pydantic's schemas
  tests/integration/test_metrics.py     # prometheus_client
  tests/integration/test_shm.py         # shared memory segments across processes, numpy
)
if [[ -n ${LOWEST_DEPS_ALL:-} ]]; then FLOOR_TESTS=(tests/integration); fi
say "pytest tests/unit ${FLOOR_TESTS[*]} -m 'not cluster' on $("$venv/bin/python" -V)"
trap - ERR
set +e
"$venv/bin/python" -m pytest -p no:cacheprovider --durations=30 tests/unit "${FLOOR_TESTS[@]}" \
  -m "not cluster" "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  say "FAILED: pytest collected no tests"
  exit 1
elif [[ $rc -ne 0 ]]; then
  say "FAILED: pytest exit $rc with the lowest direct versions (listed above)"
  exit "$rc"
fi
say "PASSED with the lowest direct versions (listed above)"
