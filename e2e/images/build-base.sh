#!/usr/bin/env bash
# Builds a Debian base image with python3 from a root filesystem made by debootstrap, then `docker import`s
# it. For machines where no image can be pulled from a registry: the images then build FROM this one
# (BASE_IMAGE). Needs root (debootstrap), a running Docker daemon and a Debian mirror.
#
#   e2e/images/build-base.sh                 # -> chunkwise/base:bookworm
#   BASE_IMAGE=my/base:tag SUITE=bookworm DEBIAN_MIRROR=http://deb.debian.org/debian e2e/images/build-base.sh
#
# The root filesystem is kept under build/images/ (gitignored) and reused; REBUILD_ROOTFS=1 starts afresh.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SUITE="${SUITE:-bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE_IMAGE="${BASE_IMAGE:-chunkwise/base:${SUITE}}"
WORK="${WORK:-${ROOT}/build/images}"
ROOTFS="${WORK}/rootfs-${SUITE}"
# python3-venv brings ensurepip's wheels (the Dockerfiles make a virtual environment); ca-certificates lets
# pip reach PyPI over TLS in the build stages.
PACKAGES="python3,python3-venv,ca-certificates"

log() { printf '[build-base] %s\n' "$*" >&2; }

if [[ "$(id -u)" != 0 ]]; then
  log "debootstrap needs root"
  exit 1
fi
for tool in debootstrap docker tar; do
  command -v "$tool" >/dev/null || {
    log "missing $tool (Debian: apt-get install -y debootstrap docker.io)"
    exit 1
  }
done
docker info >/dev/null 2>&1 || {
  log "no Docker daemon answers (start one: e2e/images/dockerd.sh start)"
  exit 1
}

if [[ "${REBUILD_ROOTFS:-0}" == 1 ]]; then
  rm -rf "$ROOTFS"
fi
if [[ ! -x "${ROOTFS}/usr/bin/python3" ]]; then
  rm -rf "$ROOTFS"
  mkdir -p "$WORK"
  log "debootstrap ${SUITE} (minbase + ${PACKAGES}) from ${DEBIAN_MIRROR} into ${ROOTFS}"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$DEBIAN_MIRROR"
  # What an image never needs at run time: package lists and caches, documentation, logs.
  rm -rf "${ROOTFS}"/var/lib/apt/lists/* "${ROOTFS}"/var/cache/apt/* "${ROOTFS}"/var/cache/debconf/*-old \
    "${ROOTFS}"/usr/share/doc/* "${ROOTFS}"/usr/share/man/* "${ROOTFS}"/usr/share/info/* \
    "${ROOTFS}"/var/log/*.log "${ROOTFS}"/var/log/apt/* "${ROOTFS}"/tmp/*
  # The same sources an official Debian image has, so that `apt-get update` works inside it.
  printf 'deb %s %s main\n' "$DEBIAN_MIRROR" "$SUITE" >"${ROOTFS}/etc/apt/sources.list"
fi

python_version="$(chroot "$ROOTFS" /usr/bin/python3 -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
log "python3 in the root filesystem: ${python_version}"

log "docker import -> ${BASE_IMAGE}"
tar -C "$ROOTFS" --numeric-owner -c . |
  docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    --message "debootstrap ${SUITE} minbase + ${PACKAGES} (python ${python_version})" \
    - "$BASE_IMAGE" >/dev/null
docker image inspect --format '{{.Id}} {{.Size}}' "$BASE_IMAGE" |
  awk -v tag="$BASE_IMAGE" '{ printf "[build-base] %s %s (%.0f MB)\n", tag, $1, $2 / 1e6 }' >&2
