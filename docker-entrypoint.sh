#!/bin/sh
# First start: fetch the models into the volume (idempotent: later starts find them and skip the download).
# QGEMM_FETCH=no skips it (bring your own models); a failed fetch (offline) still serves what is there.
set -e
if [ "${QGEMM_FETCH:-yes}" != "no" ] && [ "$1" = "qgemm" ] && [ "$2" = "serve" ]; then
  qgemm fetch || echo "qgemm fetch failed; serving the models already in $QGEMM_MODELS_DIR" >&2
fi
exec "$@"
