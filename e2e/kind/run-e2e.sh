#!/usr/bin/env bash
# `make e2e`: kind-up.sh, the kind suite (tests/e2e_kind, marker e2e_kind), then kind-down.sh; on a failure,
# diagnose.sh first. KEEP_CLUSTER=1 leaves the cluster up for a rerun (`SKIP_BUILD=1 make e2e`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export KIND_CLUSTER="${KIND_CLUSTER:-chunkwise-e2e}"
PYTEST="${PYTEST:-${ROOT}/.venv/bin/pytest}"

finish() {
  local rc=$?
  if [[ $rc != 0 ]]; then
    "${ROOT}/e2e/kind/diagnose.sh" || true
  fi
  if [[ "${KEEP_CLUSTER:-0}" != 1 ]]; then
    "${ROOT}/e2e/kind/kind-down.sh" || true
  fi
  exit "$rc"
}
trap finish EXIT

"${ROOT}/e2e/kind/kind-up.sh"
cd "$ROOT"
"$PYTEST" -q -rs -m e2e_kind --timeout=1200 tests/e2e_kind "$@"
