#!/usr/bin/env bash
# Issue 16: LoRA against full fine-tuning, `dz bench train` (the trainer's step) on one GPU. Run from the repo root
# on the device machine; JSON lines go to $OUT. On an H100 (80 GB): 5B LoRA rank 64 (full 5B fine-tuning needs
# ~80 GB of weights, grads and Adam state before activations: it does not fit). On an H200: 5B LoRA and full side
# by side, and 14B LoRA (14B full needs 4+ GPUs: its recorded rows are in docs/performance.md).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
echo "$GPU torch $(python -c 'import torch; print(torch.__version__)')"
B="python -m dzmodel.cli bench train --no-baseline --steps 6 --warmup 3"
quiet() { grep -v -i "warn\|_logging\|context_fn\|in-place\|^W11\|^ *$"; }
case "${WHAT:-5b}" in
  5b)   $B --preset dreamzero_5b --latent-hw 11,20 --out "$OUT/train_lora_5b_$GPU.jsonl" \
          --variant name=lora64,mbs=16,lora=64 --variant name=lora64_mbs20,mbs=20,lora=64 \
          --variant name=lora64_ema,mbs=16,lora=64,ema=0.999 ${EXTRA:-} 2>&1 | quiet ;;
  14b)  $B --preset dreamzero_14b --latent-hw 44,80 --out "$OUT/train_lora_14b_$GPU.jsonl" \
          --variant name=lora64_14b,mbs=1,lora=64,ac=full ${EXTRA:-} 2>&1 | quiet ;;
esac
