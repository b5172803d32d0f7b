#!/bin/sh
# Entrypoint of every image (under tini -g): run the preflight, then exec the service so that
# it gets the signals and no shell lingers. A failed hard check stops the container here, with
# the preflight's message as the last line of the log.
set -eu

/usr/local/bin/preflight.sh || exit $?
exec "$@"
