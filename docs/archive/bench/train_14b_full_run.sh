#!/usr/bin/env bash
# Run from the repo root on the device machine (4 or 8 H200s); writes the JSON lines to $OUT (set OUT=. to keep them here).
# Issue 7: the full dreamzero_14b preset over all GPUs of the host (4 or 8 H200), baseline and optimised, one run.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 NCCL_NVLS_ENABLE=0
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1; echo "$N GPUs"
if [ "$N" -ge 8 ]; then  # 30.7 GiB of states per GPU: most blocks can stay elementwise
  V="--variant name=ew,mbs=1,compile=1,ac=elementwise,attn=segments --variant name=full8,mbs=1,compile=1,ac=full:8,attn=segments"
else                     # 61 GiB of states per GPU on 4
  V="--variant name=full20,mbs=1,compile=1,ac=full:20,attn=segments --variant name=full12,mbs=1,compile=1,ac=full:12,attn=segments"
fi
torchrun --nproc_per_node $N --master_addr 127.0.0.1 --master_port 29533 -m dzmodel.cli bench train --preset dreamzero_14b --layers 0 --latent-hw 44,80 --steps 3 --warmup 2 \
  $V --variant name=baseline,mbs=1,compile=0,ac=full,attn=sdpa,encoders=online_per_sample --no-baseline \
  --out $OUT/train_14b_full_h200x$N.jsonl 2>&1 | grep -v -i warn | grep -v "^W11" | grep -v "^\[rank" | tail -14
