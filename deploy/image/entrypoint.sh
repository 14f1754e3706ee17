#!/bin/sh
# Entrypoint of the offload GPU worker image: `offload worker --handler ...` configured only from the environment.
#   OFFLOAD_HANDLER     module:function that does one job (required), importable from /app or the venv
#   OFFLOAD_SERVER      the offload server's URL, e.g. https://offload.example.com (required; the autoscaler sets
#                       it; OFFLOAD_SERVER_URL is accepted too)
#   OFFLOAD_TOKEN       a worker-scoped API key for the queue(s) below (required; never the admin key)
#   OFFLOAD_QUEUE       the queue to serve, or several comma-separated (required)
#   OFFLOAD_INSTANCE_ID, OFFLOAD_PROTECTED and the rest are read by offload itself.
# offload reads the server, token and queue from the environment itself: nothing secret goes on the command line,
# where any process on the machine could read it. Arguments given to the container are appended
# (e.g. --log-level debug). A command instead of options (the autoscaler's start command for a queue
# `deployment`: `sh -c <clone, setup, serve>`) is run as given.
set -eu

case "${1:-}" in
    "" | -*) ;;
    *) exec "$@" ;;
esac

if [ -z "${OFFLOAD_SERVER:-}" ] && [ -n "${OFFLOAD_SERVER_URL:-}" ]; then
    OFFLOAD_SERVER=$OFFLOAD_SERVER_URL
    export OFFLOAD_SERVER
fi
missing=""
for name in OFFLOAD_HANDLER OFFLOAD_SERVER OFFLOAD_TOKEN OFFLOAD_QUEUE; do
    eval "value=\${$name:-}"
    if [ -z "$value" ]; then
        missing="$missing $name"
    fi
done
if [ -n "$missing" ]; then
    echo "offload-entrypoint: set$missing (see deploy/image/README.md)" >&2
    exit 64
fi

exec offload worker \
    --handler "$OFFLOAD_HANDLER" \
    "$@"
