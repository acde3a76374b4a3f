#!/usr/bin/env bash
# Deletes the kind cluster made by kind-up.sh (and with it everything installed there).
set -euo pipefail

CLUSTER="${KIND_CLUSTER:-chunkwise-e2e}"
if ! command -v kind >/dev/null; then
  echo "[kind-down] missing kind" >&2
  exit 1
fi
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  kind delete cluster --name "$CLUSTER"
else
  echo "[kind-down] no cluster ${CLUSTER}" >&2
fi
