#!/usr/bin/env bash
# Mutation testing (mutmut) of the modules that carry Omnistage's contracts. Slow: not in CI.
#
#   hack/mutation.sh [MODULE...]        MODULE: admission spec engine drain status placement
#                                       readiness devices (default: all of them)
#   MUTATION_TESTS="tests/unit ..."     the tests mutmut may run (default: per module, below)
#   MUTATION_JOBS=N                     parallel mutants (default: 1; the dev VM has 2 cores)
#
# mutmut names mutants by file path and records hits by module name, so it needs the packages
# at the top of its source tree. The checkout keeps them under runtime/ and operator/, so this
# script stages a copy (packages at the top, tests, conftest, pyproject) under
# .mutation/<module> and runs mutmut there. Per-module kill rates go to
# .mutation/<module>/score.txt and are printed at the end; docs/testing.md records them.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
# What each module mutates: mutmut only_mutate patterns, separated by spaces.
declare -A FILE=(
  [admission]=omnistage/admission.py [spec]='omnistage/spec/*.py'
  [engine]='omnistage/orchestrator/engine.py omnistage/orchestrator/plan.py
            omnistage/orchestrator/routing.py omnistage/orchestrator/holds.py
            omnistage/orchestrator/failover.py omnistage/orchestrator/streams.py
            omnistage/orchestrator/replicas.py'
  [drain]=omni_operator/drain.py
  [status]=omni_operator/status.py [placement]=omni_operator/placement.py
  [readiness]=omni_operator/readiness.py [devices]=omnistage/devices.py
)
# The tests that exercise each module (mutmut runs only those that reach the mutated function).
declare -A TESTS=(
  [admission]="tests/unit/test_admission.py tests/unit/test_admission_contract.py tests/unit/test_params.py"
  [spec]="tests/unit/test_spec.py tests/unit/test_spec_bounds.py tests/unit/test_spec_errors.py
          tests/unit/test_validate.py"
  # engine: the fast unit tests (in-process fake replica channels). Their real-process twins,
  # tests/integration/test_orchestrator.py, take tens of seconds per mutant: not selected.
  [engine]="tests/unit/test_engine.py tests/unit/test_metrics.py"
  [drain]="tests/unit/test_drain.py"
  [status]="tests/unit/test_status.py"
  [placement]="tests/unit/test_placement.py"
  [readiness]="tests/unit/test_readiness.py tests/unit/test_drain.py"
  [devices]="tests/unit/test_devices.py"
)
MODULES=("$@")
[ ${#MODULES[@]} -eq 0 ] && MODULES=(admission spec engine drain status placement readiness devices)
command -v mutmut >/dev/null || { echo "mutmut not installed: pip install 'mutmut==3.8.1'" >&2; exit 2; }

for mod in "${MODULES[@]}"; do
  file="${FILE[$mod]:?unknown module $mod (one of ${!FILE[*]})}"
  stage="$ROOT/.mutation/$mod"
  rm -rf "$stage"
  mkdir -p "$stage"
  # examples/: the spec and validate tests load them (relative to the repository root).
  cp -r runtime/omnistage operator/omni_operator tests examples conftest.py "$stage/"
  find "$stage" -name __pycache__ -prune -exec rm -rf {} +
  tests="${MUTATION_TESTS:-${TESTS[$mod]}}"
  {
    sed '/^\[tool.mutmut\]/,$d' pyproject.toml
    echo '[tool.mutmut]'
    echo 'source_paths = ["omnistage", "omni_operator"]'
    printf 'only_mutate = [%s]\n' "$(set -f; printf '"%s", ' $file | sed 's/, $//')"
    printf 'pytest_add_cli_args_test_selection = [%s]\n' \
      "$(printf '"%s", ' $tests | sed 's/, $//')"
    echo 'use_git_change_detection = false'
    echo 'also_copy = ["conftest.py", "examples"]'
  } > "$stage/pyproject.toml"
  echo "== $mod: mutating $file, tests: $tests"
  (
    cd "$stage"
    # Worker subprocesses started by the tests import the staged packages too.
    export PYTHONPATH="$stage/mutants:$stage"
    mkdir -p mutants  # on sys.path from the start (a missing dir is cached as unimportable)
    mutmut run --max-children "${MUTATION_JOBS:-1}" >mutmut.log 2>&1 || true
    mutmut results --all true >results.txt 2>&1 || true
    python - "$mod" <<'EOF' | tee score.txt
import collections, re, sys
counts = collections.Counter()
for line in open("results.txt"):
    m = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
    if m:
        counts[m.group(2).strip()] += 1
killed = counts["killed"] + counts["timeout"]
total = sum(counts.values()) - counts["skipped"]
score = 100.0 * killed / total if total else 0.0
print(f"{sys.argv[1]}: {killed}/{total} killed ({score:.1f}%) {dict(counts)}")
EOF
  )
done
echo "== scores"
for mod in "${MODULES[@]}"; do cat "$ROOT/.mutation/$mod/score.txt" 2>/dev/null || true; done
