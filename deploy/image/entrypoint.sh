#!/bin/sh
# Entrypoint of the offload GPU worker image: `offload worker --handler ...` configured only from the environment.
#   OFFLOAD_HANDLER     module:function that does one job (required), importable from /app or the venv
#   OFFLOAD_SERVER_URL  the offload server's URL, e.g. https://offload.example.com (required; the autoscaler
#                       sets OFFLOAD_SERVER, which is read when OFFLOAD_SERVER_URL is not set)
#   OFFLOAD_TOKEN       a worker-scoped API key for the queue(s) below (required; never the admin key)
#   OFFLOAD_QUEUE       the queue to serve (required)
#   OFFLOAD_INSTANCE_ID, OFFLOAD_PROTECTED and the rest are read by offload itself.
# Arguments given to the container are appended (e.g. --log-level debug). A command instead of options (the
# autoscaler's start command for a queue `deployment`: `sh -c <clone, setup, serve>`) is run as given.
set -eu

case "${1:-}" in
    "" | -*) ;;
    *) exec "$@" ;;
esac

OFFLOAD_SERVER_URL="${OFFLOAD_SERVER_URL:-${OFFLOAD_SERVER:-}}"
missing=""
for name in OFFLOAD_HANDLER OFFLOAD_SERVER_URL OFFLOAD_TOKEN OFFLOAD_QUEUE; do
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
    --server "$OFFLOAD_SERVER_URL" \
    --token "$OFFLOAD_TOKEN" \
    --queue "$OFFLOAD_QUEUE" \
    "$@"
