#!/usr/bin/env bash
# The libero_scripted profile's train stage on a GPU machine that has neither LIBERO nor the pipeline's services
# (the device image: torch, safetensors, numpy, pyarrow, OpenCV). Run from the repo root with the recorded dataset
# (data/libero_scripted/dataset, H.264) and its statistics (runs/libero_scripted/metadata) carried along, and the
# train config written here beforehand by `dz params train-config --profile libero_scripted --out
# runs/libero_scripted/train_config.json`.
#
#   train SECONDS   train (resuming from the newest checkpoint) for at most SECONDS of wall time; checkpoints are
#                   atomic, so a cut-off run resumes where it saved last
#   export STEPS    convert the checkpoints of STEPS (e.g. 1000,2000) with the model weights in bf16, as tar parts
#                   of <= 15 MiB in $OUT (the device returns at most 16 MiB per file); `cat` them back together,
#                   then upcast_model.py restores an fp32 converted model directory
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TQDM_MININTERVAL=10
run=${RUN:-runs/libero_scripted}
case "$1" in
  train)
    timeout --signal=TERM "$2" python3 -m dzmodel.cli train --config ${CONFIG:-$run/train_config.json} \
      2>&1 | grep -v -i "warn" | tee -a $run/train.log | tail -40 || true
    cp $run/train/metrics.jsonl "$OUT/metrics.jsonl" 2>/dev/null || true
    ls $run/train/checkpoints ;;
  export)
    for step in ${2//,/ }; do
      name=step_$(printf %07d "$step")
      python3 - "$run/train" "$name" <<'PY'
import sys, torch
from pathlib import Path
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.model.state_dict import read_weights, save_safetensors_atomic
run, name = sys.argv[1], sys.argv[2]
out = Path("/tmp/export") / name
convert_checkpoint(resolve_checkpoint(run, int(name.split("_")[1])), out)
state = {k: v.to(torch.bfloat16) for k, v in read_weights(out).items()}
(out / "model.safetensors").unlink()
save_safetensors_atomic(state, out / "model.bf16.safetensors", {"format": "pt", "dtype": "bfloat16"})
PY
      tar -C /tmp/export -cf - "$name" | split -b 15M - "$OUT/$name.tar.part-"
    done
    ls -la "$OUT" ;;
  *) echo "usage: $0 train SECONDS | export STEPS" >&2; exit 2 ;;
esac
