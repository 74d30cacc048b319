#!/usr/bin/env bash
# The Prefect worker on a GPU node: polls the gpu-pool work pool and runs each flow run as a local process
# in the project checkout (prefect.yaml's pull step). prefect-worker.service runs it.
#   DZ_ENV_FILE=/etc/dreamzero/pool.env infra/prefect/worker.sh
set -euo pipefail
ENV_FILE=${DZ_ENV_FILE:-/etc/dreamzero/pool.env}
# shellcheck source=/dev/null
if [[ -f $ENV_FILE ]]; then set -a; . "$ENV_FILE"; set +a; fi
: "${DZ_PROJECT_DIR:?set DZ_PROJECT_DIR (the project checkout) in $ENV_FILE}"
: "${PREFECT_API_URL:?set PREFECT_API_URL (the Prefect server of the pool) in $ENV_FILE}"
export DZ_PROJECT_DIR PREFECT_API_URL
export DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DVC_NO_ANALYTICS=1
export OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0
export PATH="$DZ_PROJECT_DIR/.venv/bin:$PATH"
cd "$DZ_PROJECT_DIR"
exec prefect worker start --pool "${DZ_WORK_POOL:-gpu-pool}" --type process --name "dz-$(hostname -s)"
