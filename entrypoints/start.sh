#!/bin/sh
# Entrypoint of every image (under tini -g): run the preflight, then exec the service so that
# it gets the signals and no shell lingers. A failed hard check stops the container here, with
# the preflight's message as the last line of the log.
set -eu

/usr/local/bin/preflight.sh || exit $?
# torch's and Triton's kernel caches on the torch-cache volume: made here, not in the image,
# because a new named volume is filled from the image on first mount and two services
# starting at once raced on the subfolders ("file exists"); mkdir -p does not race.
for dir in "${TORCHINDUCTOR_CACHE_DIR:-}" "${TRITON_CACHE_DIR:-}"; do
    if [ -n "$dir" ]; then mkdir -p "$dir" 2>/dev/null || true; fi
done
exec "$@"
