#!/bin/sh
# Install and start a Docker engine with Compose v2 and buildx on a Debian 12 machine
# (ENVIRONMENT.md's verified recipe). Idempotent: does nothing that is already done.
set -eu

log() { printf '[setup-docker] %s\n' "$*" >&2; }

have_plugin() { docker "$1" version >/dev/null 2>&1; }

if ! command -v dockerd >/dev/null 2>&1 || ! command -v mmdebstrap >/dev/null 2>&1; then
    log "installing docker.io and mmdebstrap from Debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        docker.io mmdebstrap iptables >/dev/null
fi

if ! have_plugin compose || ! have_plugin buildx; then
    log "installing docker-compose and docker-buildx from trixie (static Go binaries)"
    mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
    tmp_src=/etc/apt/sources.list.d/zz-trixie-tmp.list
    echo "deb ${mirror:-http://deb.debian.org/debian} trixie main" >"$tmp_src"
    workdir=$(mktemp -d)
    trap 'rm -f "$tmp_src"; rm -rf "$workdir"' EXIT
    apt-get update -qq
    (cd "$workdir" && apt-get download -qq docker-compose/trixie docker-buildx/trixie)
    dpkg -i "$workdir"/*.deb >/dev/null
    rm -f "$tmp_src"
    apt-get update -qq
fi

if ! docker info >/dev/null 2>&1; then
    log "starting dockerd (log: /tmp/dockerd.log)"
    # setsid: the engine must outlive the shell that started it.
    setsid nohup dockerd --storage-driver overlay2 >/tmp/dockerd.log 2>&1 &
    i=0
    until docker info >/dev/null 2>&1; do
        i=$((i + 1))
        if [ "$i" -gt 60 ]; then
            log "dockerd did not answer within 60 s; last lines of /tmp/dockerd.log:"
            tail -n 20 /tmp/dockerd.log >&2
            exit 1
        fi
        sleep 1
    done
fi
log "docker $(docker version --format '{{.Server.Version}}'), $(docker compose version --short) compose, buildx $(docker buildx version | awk '{print $2}')"
