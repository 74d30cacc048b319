#!/usr/bin/env bash
# The LoRA / full / EMA comparison of docs/results.md section 7, on the GPU machine, after both runs trained
# (`PROFILE=libero_scripted` and `PROFILE=libero_scripted_lora`, `libero_scripted_gpu.sh train-bg`). Started detached by
# `libero_scripted_gpu.sh compare-bg`; each result lands in runs/compare/<name>/ as soon as it exists, most important
# first, so that a machine taken back mid-queue still leaves the first ones (`collect`).
set -uo pipefail
export PYTHONPATH=/tmp/libero/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TQDM_MININTERVAL=30
export LIBERO_CONFIG_PATH=/tmp/libero/config MUJOCO_GL=egl
dz() { python3 -m dzmodel.cli "$@"; }
full=runs/libero_scripted/train lora=runs/libero_scripted_lora/train out=runs/compare
episodes=${EPISODES:-10}
solver=(--solver-steps 4 --cfg-scale 1)
evaluate() {  # NAME RUN STEPS WEIGHTS [ARGS]: LIBERO-Object tasks 0-3, standard init states 0..episodes-1
  local name=$1 run=$2 steps=$3 weights=$4; shift 4
  echo "[$(date +%T)] eval $name: $run steps $steps weights $weights $*"
  dz eval libero "$run" --steps "$steps" --weights "$weights" --suite object --tasks 0,1,2,3 --episodes "$episodes" \
    --workers 15 --camera-size 128 --videos 1 --device cuda --no-progress --out "$out/$name" "${solver[@]}" "$@" \
    | tail -n 8
}
preview() {  # NAME RUN STEP WEIGHTS: the world model's predicted video of 4 windows, beside the real frames
  local name=$1 run=$2 step=$3 weights=$4 model=$out/models/$1
  dz convert "$run" --step "$step" --weights "$weights" --out "$model" >/dev/null &&
    dz eval previews "$model" --out "$out/previews/$name" --windows 4 --device cuda "${solver[@]}" | tail -n 1
}
while pgrep -f "dzmodel.cli train" >/dev/null; do sleep 10; done
echo "[$(date +%T)] trainings ended"
evaluate full_raw $full 1500,3000 raw
evaluate full_ema $full 1500,3000 ema
evaluate lora_ema $lora 3000 ema
evaluate lora_raw $lora 3000 raw
for step in 500 1000 1500 2000 2500 3000; do preview "full_raw_$step" $full $step raw; done
preview full_ema_3000 $full 3000 ema
preview lora_ema_3000 $lora 3000 ema
evaluate full_ema_more $full 1000,2000,2500 ema
evaluate full_raw_more $full 1000,2000,2500 raw
# issue 14's open point: the deployed 16-step solver with upstream's DiT schedule against the 16-step reference
solver=(--solver-steps 16 --cfg-scale 1 --dit-steps upstream)
evaluate full_ema_16_upstream $full 3000 ema
solver=(--solver-steps 16 --cfg-scale 1 --dit-steps '')
evaluate full_ema_16_reference $full 3000 ema
echo "[$(date +%T)] done"
