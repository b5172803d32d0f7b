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

# First start: the getting-started notebook into the workspace (a copy the user may edit),
# and, when nothing is mounted at the dataset path, a demo dataset made in the background
# (gpufeed synth, a few seconds; written under .partial and renamed, so a half-made one never
# looks finished) that GPUFEED_DATA_DIR then points at for the notebooks and terminals.
examples=${GPUFEED_EXAMPLES_DIR:-/opt/gpufeed/examples}
if [ -w "$root_dir" ] && [ -f "$examples/getting-started.ipynb" ] &&
    [ ! -e "$root_dir/getting-started.ipynb" ]; then
    cp "$examples/getting-started.ipynb" "$root_dir/" ||
        log "could not copy getting-started.ipynb into $root_dir"
fi
data_dir=${GPUFEED_DATA_DIR:-/data}
demo_dir=${GPUFEED_DEMO_DIR:-$root_dir/demo-data}
if [ -z "$(ls -A "$data_dir" 2>/dev/null)" ] && [ "$demo_dir" != "$data_dir" ]; then
    if [ -n "$(ls -A "$demo_dir" 2>/dev/null)" ]; then
        log "$data_dir is empty; GPUFEED_DATA_DIR=$demo_dir (the demo dataset)"
        GPUFEED_DATA_DIR=$demo_dir
    elif [ -w "$(dirname "$demo_dir")" ] && command -v gpufeed >/dev/null 2>&1; then
        log "$data_dir is empty; making a demo dataset in $demo_dir in the background (gpufeed synth); GPUFEED_DATA_DIR=$demo_dir"
        gpufeed synth --quiet "$demo_dir" >/dev/null 2>"${TMPDIR:-/tmp}/gpufeed-synth.log" &
        GPUFEED_DATA_DIR=$demo_dir
    fi
    export GPUFEED_DATA_DIR
fi

exec jupyter lab \
    --ServerApp.ip=0.0.0.0 \
    --ServerApp.port="${JUPYTER_PORT:-8888}" \
    --ServerApp.open_browser=False \
    --ServerApp.root_dir="$root_dir" \
    "$@"
