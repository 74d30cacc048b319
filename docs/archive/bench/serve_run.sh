#!/usr/bin/env bash
# dz serve with 8 concurrent clients on one GPU (`dz bench serve`: openpi's websocket client against the server of
# `dz serve`, batching off and on), for the 5B at the deployed setting (16 solver steps, DiT caching, CFG 5, bf16,
# CUDA graphs, compile). Run from the repo root on the device machine with the wheels the GPU image lacks carried
# in .serve_wheels (websockets, msgpack, openpi-client, dm-tree, pillow for Python 3.12:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --no-deps \
#     -d .serve_wheels websockets msgpack openpi-client dm-tree pillow
# ). JSON lines go to $OUT.
#   EMBODIMENT  the protocol and views served (default libero_sim_5b_frame, docs/bench/libero_5b_frame.yaml: LIBERO's
#               two cameras in the 5B's own 176x320 frame, the frame `dz bench policy` times; oxe_droid: DROID's
#               three cameras, a 352x640 frame)
#   CLIENTS (8), MAX_BATCH (8), REQUESTS (20 timed per client), PRESET (dreamzero_5b), PERIOD_MS (0: each client asks
#   again as soon as it is answered; P: every P ms, as a robot playing each chunk for P ms)
set -euo pipefail
site=/tmp/serve_site
if ! python3 -c "import websockets, msgpack, openpi_client" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .serve_wheels/*.whl
fi
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
preset=${PRESET:-dreamzero_5b}
emb=${EMBODIMENT:-libero_sim_5b_frame}
python3 -m dzmodel.cli bench serve --preset "$preset" --embodiment "$emb" --embodiments docs/bench/libero_5b_frame.yaml \
  --device cuda --compile \
  --clients "${CLIENTS:-8}" --max-batch "${MAX_BATCH:-8}" --requests "${REQUESTS:-20}" --warmup 3 \
  --period-ms "${PERIOD_MS:-0}" --out "$OUT/serve_${preset}_${emb}_$GPU.jsonl"
