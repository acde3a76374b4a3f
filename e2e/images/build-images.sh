#!/usr/bin/env bash
# Builds the runtime and operator images from the repository root (runtime/Dockerfile, operator/Dockerfile)
# and prints each one's build time and size.
#
#   e2e/images/build-images.sh                          # FROM python:3.11-slim-bookworm, torch from PyTorch's CPU index
#   BASE_IMAGE=chunkwise/base:bookworm e2e/images/build-images.sh   # what images-local.sh runs
#
# Environment: BASE_IMAGE, TAG (0.1.0), RUNTIME_IMAGE, OPERATOR_IMAGE, TORCH_SPEC, TORCH_INDEX (set, even
# empty, to override the Dockerfile's CPU index), DOCKER_BUILD_NETWORK (e.g. host), ONLY (runtime|operator).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TAG="${TAG:-0.1.0}"
RUNTIME_IMAGE="${RUNTIME_IMAGE:-chunkwise/runtime:${TAG}}"
OPERATOR_IMAGE="${OPERATOR_IMAGE:-chunkwise/operator:${TAG}}"
ONLY="${ONLY:-}"

log() { printf '[build-images] %s\n' "$*" >&2; }

command -v docker >/dev/null || {
  log "missing docker"
  exit 1
}
docker info >/dev/null 2>&1 || {
  log "no Docker daemon answers"
  exit 1
}

common=()
if [[ -n "${BASE_IMAGE:-}" ]]; then
  common+=(--build-arg "BASE_IMAGE=${BASE_IMAGE}")
fi
if [[ -n "${DOCKER_BUILD_NETWORK:-}" ]]; then
  common+=(--network "$DOCKER_BUILD_NETWORK")
fi
runtime_args=()
if [[ -n "${TORCH_SPEC:-}" ]]; then
  runtime_args+=(--build-arg "TORCH_SPEC=${TORCH_SPEC}")
fi
if [[ -n "${TORCH_INDEX+set}" ]]; then
  runtime_args+=(--build-arg "TORCH_INDEX=${TORCH_INDEX}")
fi

build() {
  local name="$1" dockerfile="$2" image="$3"
  shift 3
  local start end
  start="$(date +%s)"
  log "docker build -f ${dockerfile} -t ${image} ${common[*]} $*"
  docker build -f "${ROOT}/${dockerfile}" -t "$image" "${common[@]}" "$@" "$ROOT"
  end="$(date +%s)"
  docker image inspect --format '{{.Size}}' "$image" |
    awk -v name="$name" -v image="$image" -v secs="$((end - start))" \
      '{ printf "[build-images] %s: %s built in %d s, %.0f MB\n", name, image, secs, $1 / 1e6 }' >&2
}

if [[ -z "$ONLY" || "$ONLY" == runtime ]]; then
  build runtime runtime/Dockerfile "$RUNTIME_IMAGE" "${runtime_args[@]}"
fi
if [[ -z "$ONLY" || "$ONLY" == operator ]]; then
  build operator operator/Dockerfile "$OPERATOR_IMAGE"
fi
