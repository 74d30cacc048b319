#!/usr/bin/env bash
# Run from the repo root on a GPU machine, after building a tiny-preset encoder cache into gpucheck/cache
# (dz data synth + dz data metadata + dz cache with the tabletop_pusher embodiment of tests/train/test_trainer.py).
# FSDP2 over 2 GPUs (NCCL) on the tiny preset from the encoder cache, compared with the 1-GPU plain run.
# ATTN / AC choose the attention backend and recompute (the first run used ATTN=flex AC=full).
set -e; set -o pipefail || true
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name --format=csv,noheader
COMMON="--set cache=gpucheck/cache --set steps=50 --set save_every=25 --set global_batch=8 --set lr=0.0003 --set precision=bf16 --set reduce_dtype=fp32 --set progress=false --preset tiny"
torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29511 -m dzmodel.cli train $COMMON --set micro_batch=4 --set compile=true --set attn_backend=${ATTN:-segments} --set activation_checkpointing=${AC:-elementwise} --out $OUT/fsdp 2>&1 | { grep -v -i warn | grep -iE "error|raise|line [0-9]+" || true; } | tail -25
ls $OUT/fsdp/checkpoints/step_0000050
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
a = [json.loads(l)["loss"] for l in open("gpucheck/plain_metrics.jsonl")]
b = [json.loads(l)["loss"] for l in open(f"{o}/fsdp/metrics.jsonl")]
rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
print(f"FSDP2 x2 vs 1-GPU plain: steps {len(a)}/{len(b)}  max rel diff {max(rel):.2e}  mean {sum(rel)/len(rel):.2e}")
PY
cp $OUT/fsdp/metrics.jsonl $OUT/fsdp2_metrics.jsonl; rm -rf $OUT/fsdp
