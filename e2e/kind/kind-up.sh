#!/usr/bin/env bash
# A kind cluster with chunkwise installed: create the cluster (unless it exists), build both images, load
# them into the node, install the CRDs from crds/ and the operator from manifests/ (through the e2e/kind
# overlay), and wait until the operator runs.
#
#   e2e/kind/kind-up.sh                       # cluster "chunkwise-e2e", kubectl context "kind-chunkwise-e2e"
#   KIND_CLUSTER=dev SKIP_BUILD=1 e2e/kind/kind-up.sh
#
# Environment: KIND_CLUSTER (chunkwise-e2e), KIND_NODE_IMAGE (kind's default node image if unset),
# SKIP_BUILD=1 (load images built before, e.g. by `make images-local`), and what e2e/images/build-images.sh
# reads (BASE_IMAGE, TORCH_INDEX, DOCKER_BUILD_NETWORK).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CLUSTER="${KIND_CLUSTER:-chunkwise-e2e}"
CONTEXT="kind-${CLUSTER}"
# The tag manifests/kustomization.yaml and manifests/examples/service.yaml name.
export TAG=0.1.0 RUNTIME_IMAGE=chunkwise/runtime:0.1.0 OPERATOR_IMAGE=chunkwise/operator:0.1.0
NAMESPACE=chunkwise-system
CRD=inferenceservices.serving.chunkwise.dev

log() { printf '[kind-up] %s\n' "$*" >&2; }

for tool in kind kubectl docker; do
  command -v "$tool" >/dev/null || {
    log "missing ${tool} (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
    exit 1
  }
done

if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "cluster ${CLUSTER} exists"
else
  args=(--name "$CLUSTER" --config "${ROOT}/e2e/kind/cluster.yaml" --wait 180s)
  if [[ -n "${KIND_NODE_IMAGE:-}" ]]; then
    args+=(--image "$KIND_NODE_IMAGE")
  fi
  log "kind create cluster ${args[*]}"
  kind create cluster "${args[@]}"
fi

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  "${ROOT}/e2e/images/build-images.sh"
fi
log "kind load docker-image ${RUNTIME_IMAGE} ${OPERATOR_IMAGE}"
kind load docker-image --name "$CLUSTER" "$RUNTIME_IMAGE" "$OPERATOR_IMAGE"

# The CRDs first, on their own (manifests/ does not hold them, so deleting the install keeps the services).
log "kubectl apply -k crds (the CRDs)"
kubectl --context "$CONTEXT" apply -k "${ROOT}/crds"
kubectl --context "$CONTEXT" wait --for condition=Established "crd/${CRD}" --timeout=60s
log "kubectl apply -k e2e/kind (namespace, RBAC, operator)"
kubectl --context "$CONTEXT" apply -k "${ROOT}/e2e/kind"
# A reinstall over a running operator with a rebuilt image of the same tag: start it afresh.
kubectl --context "$CONTEXT" -n "$NAMESPACE" rollout restart deployment/chunkwise-operator
kubectl --context "$CONTEXT" -n "$NAMESPACE" rollout status deployment/chunkwise-operator --timeout=180s
log "ready: kubectl --context ${CONTEXT} apply -f manifests/examples/service.yaml"
