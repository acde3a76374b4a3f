#!/usr/bin/env bash
# The images on a machine that can pull nothing from a registry (`make images-local`):
#   1. a Debian base image with python3, from debootstrap + `docker import` (build-base.sh);
#   2. torch's wheel laid into e2e/images/extras/ (PyTorch's index is out of reach; PyPI's torch for Linux
#      is a CUDA build): TORCH_WHEEL if given, else what `pip download torch==2.13.0` finds (here, the CPU
#      wheel on this machine's disk), refused unless it is a CPU build;
#   3. the host's CA bundle beside it, for pip inside the builds (a TLS-intercepting proxy);
#   4. both images FROM that base (build-images.sh).
# Then `pytest -m slow tests/e2e_kind/test_images.py` runs them. Needs root and a Docker daemon
# (e2e/images/dockerd.sh start, where none runs).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="${ROOT}/e2e/images"
EXTRAS="${HERE}/extras"
export BASE_IMAGE="${BASE_IMAGE:-chunkwise/base:bookworm}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PIP="${PIP:-python3 -m pip}"

log() { printf '[images-local] %s\n' "$*" >&2; }

docker info >/dev/null 2>&1 || {
  log "no Docker daemon answers (start one: e2e/images/dockerd.sh start)"
  exit 1
}

total_start="$(date +%s)"
if [[ "${REBUILD_BASE:-0}" == 1 ]] || ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  start="$(date +%s)"
  "${HERE}/build-base.sh"
  log "base image built in $(($(date +%s) - start)) s"
else
  log "reusing ${BASE_IMAGE} (REBUILD_BASE=1 makes it again)"
fi

# The wheel must match the base image's Python, not this machine's.
py_tag="$(docker run --rm --network none "$BASE_IMAGE" python3 -c 'import sys; print("%d%d" % sys.version_info[:2])')"
find "$EXTRAS" -maxdepth 1 -name 'torch-*.whl' -delete
if [[ -n "${TORCH_WHEEL:-}" ]]; then
  cp "$TORCH_WHEEL" "$EXTRAS/"
else
  log "${PIP} download ${TORCH_SPEC} for cp${py_tag}"
  # shellcheck disable=SC2086  # PIP is a command line
  $PIP download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$py_tag" \
    --dest "$EXTRAS" "$TORCH_SPEC"
fi
wheel="$(find "$EXTRAS" -maxdepth 1 -name 'torch-*.whl' -printf '%f\n')"
case "$wheel" in
  *+cpu-cp"${py_tag}"-*) log "torch wheel: ${wheel}" ;;
  *)
    log "refusing ${wheel:-no wheel}: not a CPU build for cp${py_tag} (set TORCH_WHEEL to one)"
    exit 1
    ;;
esac

ca_bundle="${CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}"
rm -f "${EXTRAS}/ca-certificates.crt"
if [[ "$ca_bundle" != none && -f "$ca_bundle" ]]; then
  cp "$ca_bundle" "${EXTRAS}/ca-certificates.crt"
  log "CA bundle for the build stages: ${ca_bundle}"
fi

"${HERE}/build-images.sh"
log "done in $(($(date +%s) - total_start)) s"
docker image ls --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep '^chunkwise/' >&2
