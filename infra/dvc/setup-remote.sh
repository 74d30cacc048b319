#!/usr/bin/env bash
# The pool's DVC remote: an S3 bucket (the MinIO of infra/mlflow/, or any S3), made this checkout's default.
#   infra/dvc/setup-remote.sh s3://dvc/dreamzero http://mlflow-host:9000     # MinIO: give its endpoint
#   infra/dvc/setup-remote.sh s3://my-bucket/dvc                              # AWS S3: no endpoint
# Then: dvc push (after `dvc repro`) and, on another node or checkout, dvc pull.
# Written to .dvc/config.local (this checkout only, not committed), so the repository's default remote for
# CI and the demo stays as it is. DZ_DVC_SCOPE=project writes .dvc/config instead, to commit for the team.
# Credentials: boto3 reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from the environment (pool.env);
# DZ_DVC_STORE_CREDENTIALS=1 also stores them in .dvc/config.local.
set -euo pipefail
URL=${1:?usage: infra/dvc/setup-remote.sh s3://BUCKET/PATH [ENDPOINT_URL]}
ENDPOINT=${2:-${DVC_S3_ENDPOINT:-}}
NAME=${DZ_DVC_REMOTE:-pool}
export DVC_NO_ANALYTICS=1
case $URL in s3://*) ;; *) echo "setup-remote.sh: $URL is not an s3:// URL" >&2; exit 2 ;; esac
case ${DZ_DVC_SCOPE:-local} in
  local) SCOPE=(--local) ;;
  project) SCOPE=() ;;
  *) echo "setup-remote.sh: DZ_DVC_SCOPE must be local or project" >&2; exit 2 ;;
esac
cd "${DZ_PROJECT_DIR:-.}"
dvc remote add "${SCOPE[@]}" --default --force "$NAME" "$URL"
if [[ -n $ENDPOINT ]]; then
  dvc remote modify "${SCOPE[@]}" "$NAME" endpointurl "$ENDPOINT"
fi
dvc remote modify "${SCOPE[@]}" "$NAME" region "${AWS_DEFAULT_REGION:-us-east-1}"
if [[ ${DZ_DVC_STORE_CREDENTIALS:-0} == 1 ]]; then
  : "${AWS_ACCESS_KEY_ID:?set AWS_ACCESS_KEY_ID}" "${AWS_SECRET_ACCESS_KEY:?set AWS_SECRET_ACCESS_KEY}"
  dvc remote modify --local "$NAME" access_key_id "$AWS_ACCESS_KEY_ID"
  dvc remote modify --local "$NAME" secret_access_key "$AWS_SECRET_ACCESS_KEY"
fi
dvc remote list
echo "DVC remote $NAME -> $URL is the default here; dvc push / dvc pull use it"
