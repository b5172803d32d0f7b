#!/bin/sh
# JupyterLab on 0.0.0.0:8888 inside the container, token always required.
# Token: JUPYTER_TOKEN, else the file named by JUPYTER_TOKEN_FILE, else a random one that
# Jupyter makes and prints in the log. An empty token never disables authentication.
set -eu

log() { printf 'gpufeed jupyter: %s\n' "$*" >&2; }

if [ -n "${JUPYTER_TOKEN_FILE:-}" ]; then
    if [ ! -r "$JUPYTER_TOKEN_FILE" ]; then
        log "JUPYTER_TOKEN_FILE=$JUPYTER_TOKEN_FILE is not a readable file"
        exit 64
    fi
    JUPYTER_TOKEN=$(tr -d '\r\n' <"$JUPYTER_TOKEN_FILE")
    if [ -z "$JUPYTER_TOKEN" ]; then
        log "JUPYTER_TOKEN_FILE=$JUPYTER_TOKEN_FILE is empty; refusing to start without a token"
        exit 64
    fi
    export JUPYTER_TOKEN
elif [ -n "${JUPYTER_TOKEN+set}" ] && [ -z "$JUPYTER_TOKEN" ]; then
    # Jupyter itself would read an empty JUPYTER_TOKEN as "no authentication".
    log "JUPYTER_TOKEN is set but empty; using a random token instead (see the URL below)"
    unset JUPYTER_TOKEN
fi

root_dir=${JUPYTER_ROOT_DIR:-/workspace}
exec jupyter lab \
    --ServerApp.ip=0.0.0.0 \
    --ServerApp.port="${JUPYTER_PORT:-8888}" \
    --ServerApp.open_browser=False \
    --ServerApp.root_dir="$root_dir" \
    "$@"
