#!/usr/bin/env bash
# Issue 15: `dz train` (what users run: data loader, pinned copies, the trainer's step) against `dz bench train`
# (the same step on synthetic device batches) at the optimised 5B configuration on one GPU. Run from the repo
# root on the device machine; JSON goes to $OUT. PART=train runs the guard and dz train, PART=bench the bench
# and the comparison (two calls: each stays under the device's 10-minute limit); default both.
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PART=${PART:-all}
STEPS=${STEPS:-12}
WORK=${WORK:-build/train_vs_bench}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
echo "$GPU torch $(python -c 'import torch; print(torch.__version__)')"
mkdir -p "$WORK"
if [ "$PART" != bench ]; then
  # the no-synchronisation guard of the step, on the GPU
  python -c "import tests.train.test_step as t; t.test_a_cuda_step_never_synchronises(); print('guard: a CUDA step never synchronises: ok')"
  python -m dzmodel.cli cache --synthetic 64 --preset dreamzero_5b --latent-hw 11,20 --out "$WORK/cache_5b"
  rm -rf "$WORK/run_5b"
  python -m dzmodel.cli train --preset dreamzero_5b --steps "$STEPS" --out "$WORK/run_5b" \
    --set cache="$WORK/cache_5b" --set micro_batch=21 --set global_batch=21 --set compile=true \
    --set activation_checkpointing=elementwise --set attn_backend=segments --set precision=bf16 \
    --set num_workers=2 --set save_every=0 --set progress=false
  cp "$WORK/run_5b/metrics.jsonl" "$OUT/train_5b_dz_train_$GPU.jsonl"
fi
if [ "$PART" != train ]; then
  python -m dzmodel.cli bench train --preset dreamzero_5b --no-baseline --steps 8 --warmup 3 \
    --against-run "$WORK/run_5b" --out "$OUT/train_5b_bench_vs_train_$GPU.jsonl"
fi
