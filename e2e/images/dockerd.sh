#!/usr/bin/env bash
# Starts or stops a Docker daemon in the background, for machines without a service manager (a session's
# sandbox). `start` does nothing when a daemon already answers; `stop` ends only the one `start` started.
#
#   e2e/images/dockerd.sh start | stop | status
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE="${DOCKERD_STATE:-${ROOT}/build/dockerd}"
PIDFILE="${STATE}/dockerd.pid"
LOG="${STATE}/dockerd.log"

log() { printf '[dockerd] %s\n' "$*" >&2; }

case "${1:-}" in
  start)
    if docker info >/dev/null 2>&1; then
      log "a daemon already answers"
      exit 0
    fi
    command -v dockerd >/dev/null || {
      log "no dockerd (Debian: apt-get install -y docker.io)"
      exit 1
    }
    mkdir -p "$STATE"
    nohup dockerd >"$LOG" 2>&1 &
    echo $! >"$PIDFILE"
    for _ in $(seq 60); do
      if docker info >/dev/null 2>&1; then
        log "dockerd $(cat "$PIDFILE") answers (log: ${LOG})"
        exit 0
      fi
      if ! kill -0 "$(cat "$PIDFILE")" 2>/dev/null; then
        log "dockerd exited:"
        tail -20 "$LOG" >&2
        exit 1
      fi
      sleep 1
    done
    log "dockerd did not answer within 60 s; see ${LOG}"
    exit 1
    ;;
  stop)
    if [[ ! -f "$PIDFILE" ]]; then
      log "no daemon was started here"
      exit 0
    fi
    pid="$(cat "$PIDFILE")"
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid"
      for _ in $(seq 30); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
      done
    fi
    rm -f "$PIDFILE"
    log "stopped dockerd ${pid}"
    ;;
  status)
    docker info --format '{{.ServerVersion}} {{.Driver}}' 2>/dev/null || {
      log "no daemon answers"
      exit 1
    }
    ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
