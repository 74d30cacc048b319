#!/usr/bin/env bash
# The Prefect server (API + UI + scheduler) for the GPU pool; prefect-server.service runs it.
#   DZ_ENV_FILE=/etc/dreamzero/pool.env infra/prefect/server.sh
set -euo pipefail
ENV_FILE=${DZ_ENV_FILE:-/etc/dreamzero/pool.env}
# shellcheck source=/dev/null
if [[ -f $ENV_FILE ]]; then set -a; . "$ENV_FILE"; set +a; fi
: "${DZ_PROJECT_DIR:?set DZ_PROJECT_DIR (the project checkout) in $ENV_FILE}"
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false
export PATH="$DZ_PROJECT_DIR/.venv/bin:$PATH"
exec prefect server start --host "${PREFECT_SERVER_API_HOST:-0.0.0.0}" --port "${PREFECT_SERVER_API_PORT:-4200}" \
  --analytics-off
