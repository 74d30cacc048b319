#!/usr/bin/env bash
# Training from an s3:// dataset against the same dataset on local disk, on the GPU machine: a moto S3 server on
# loopback (the image has no S3 client or server: their wheels are carried in .s3wheels, built with
# `pip download --only-binary=:all: --python-version 3.12 ... "moto[server]==5.2.5" boto3`, --no-deps subset), the
# synthetic recording of `fastpath_gpu.sh synth` uploaded to it, then `fastpath_gpu.sh measure` on each, through the
# CPU loader (train.data_on_device: false: every window's frames are read from the files, so the cache is read all
# along). DZ_DATA_CACHE_GIB (default 0.25) is the cache's budget, below the recording's size, so files are evicted
# and fetched again. Rows (ROWS, default "local s3"): stream_local, stream_s3 (logs and metrics in $OUT).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
python3 -m pip install -q --no-deps --no-compile --no-cache-dir --target /tmp/s3site .s3wheels/*.whl
export PYTHONPATH=$PWD:/tmp/s3site
synth=data/fastpath_synth
[[ -d $synth ]] || bash "$here/fastpath_gpu.sh" synth > /tmp/synth.log 2>&1
export AWS_ACCESS_KEY_ID=testing AWS_SECRET_ACCESS_KEY=testing AWS_DEFAULT_REGION=us-east-1
export AWS_ENDPOINT_URL=http://127.0.0.1:5123 DZ_DATA_CACHE=/tmp/dz-cache DZ_DATA_CACHE_GIB=${DZ_DATA_CACHE_GIB:-0.25}
python3 -m moto.server -H 127.0.0.1 -p 5123 > /tmp/moto.log 2>&1 &
moto=$!
trap 'kill $moto' EXIT
for _ in $(seq 60); do curl -sf http://127.0.0.1:5123/moto-api/ > /dev/null && break; sleep 0.5; done
python3 - "$synth" <<'PY'
import sys, pathlib, boto3
root = pathlib.Path(sys.argv[1])
s3 = boto3.client("s3")
s3.create_bucket(Bucket="lake")
files = [f for f in root.rglob("*") if f.is_file()]
for f in files:
    s3.upload_file(str(f), "lake", f"synth/{f.relative_to(root).as_posix()}")
print(f"uploaded {len(files)} files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB")
PY
common=(micro_batch=128 compile=false data_on_device=false num_workers=12 frame_cache_mib=0)
if [[ ${ROWS:-local s3} == *local* ]]; then
  STEPS=${STEPS:-40} LOG_EVERY=10 VARIANT=stream_local bash "$here/fastpath_gpu.sh" measure "$synth" "${common[@]}" \
    2>&1 | grep -v -i warn | tail -3
fi
STEPS=${STEPS:-40} LOG_EVERY=10 VARIANT=stream_s3 METADATA_DATASET=$synth bash "$here/fastpath_gpu.sh" measure \
  s3://lake/synth "${common[@]}" 2>&1 | grep -v -i warn | tail -3
du -sh "$DZ_DATA_CACHE"
