#!/usr/bin/env bash
# Once, against the pool's Prefect server: the work pool, the gpu-pool tag concurrency limit, and the nightly
# deployment of prefect.yaml for one profile. Safe to run again (what exists is kept; the deployment is updated).
# `dz deploy --param profile=libero_5b` does the same from Python.
#   DZ_ENV_FILE=/etc/dreamzero/pool.env infra/prefect/setup.sh [PROFILE]
# Environment: DZ_WORK_POOL (gpu-pool), DZ_GPU_SLOTS (1: GPU-tagged tasks that may run at once on the pool).
set -euo pipefail
ENV_FILE=${DZ_ENV_FILE:-/etc/dreamzero/pool.env}
# shellcheck source=/dev/null
if [[ -f $ENV_FILE ]]; then set -a; . "$ENV_FILE"; set +a; fi
: "${DZ_PROJECT_DIR:?set DZ_PROJECT_DIR (the project checkout) in $ENV_FILE}"
: "${PREFECT_API_URL:?set PREFECT_API_URL (the Prefect server of the pool) in $ENV_FILE}"
export PREFECT_API_URL DO_NOT_TRACK=true PREFECT_SERVER_ANALYTICS_ENABLED=false
export PATH="$DZ_PROJECT_DIR/.venv/bin:$PATH"
PROFILE=${1:-${DZ_PROFILE:-libero_5b}}
POOL=${DZ_WORK_POOL:-gpu-pool}
SLOTS=${DZ_GPU_SLOTS:-1}
cd "$DZ_PROJECT_DIR"

if prefect work-pool inspect "$POOL" >/dev/null 2>&1; then
  echo "work pool $POOL exists"
else
  prefect work-pool create "$POOL" --type process
fi
# Tasks tagged gpu-pool (cache, train, eval) take one slot each.
if prefect concurrency-limit inspect gpu-pool >/dev/null 2>&1; then
  echo "concurrency limit gpu-pool exists"
else
  prefect concurrency-limit create gpu-pool "$SLOTS"
fi
prefect --no-prompt deploy --prefect-file "$DZ_PROJECT_DIR/prefect.yaml" --name nightly --pool "$POOL" \
  --param profile="$PROFILE"
echo "deployment sft-pipeline/nightly ($PROFILE) on $POOL; start a worker: infra/prefect/worker.sh"
