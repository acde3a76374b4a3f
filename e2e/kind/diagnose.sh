#!/usr/bin/env bash
# What the cluster looked like, for a failed run: objects, events, the operator's and the engines' logs,
# and `kind export logs` under LOGS (build/kind-logs), which CI uploads. Never fails.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${KIND_CLUSTER:-chunkwise-e2e}"
CONTEXT="kind-${CLUSTER}"
LOGS="${LOGS:-${ROOT}/build/kind-logs}"
k() { kubectl --context "$CONTEXT" "$@"; }

echo "=== objects"
k get inferenceservices,deployments,replicasets,pods,services,poddisruptionbudgets -A -o wide
echo "=== inferenceservices"
k get inferenceservices -A -o yaml
echo "=== events"
k get events -A --sort-by=.lastTimestamp
echo "=== operator"
k -n chunkwise-system logs deployment/chunkwise-operator --tail=300
echo "=== runtime pods"
k -n default logs -l app.kubernetes.io/component=runtime --tail=100 --prefix
mkdir -p "$LOGS"
kind export logs --name "$CLUSTER" "$LOGS" >/dev/null 2>&1 && echo "=== node logs in ${LOGS}"
exit 0
