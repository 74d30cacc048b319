#!/usr/bin/env bash
# One row of the LIBERO-Object screen (docs/results.md), detached so that it outlives the command that starts it:
# the recording when RECORD_SET is given (`dz stage fetch --profile PROFILE $RECORD_SET`, e.g. DART noise), the
# metadata, vision (unless TRAIN_SET turns it off) and train config of VARIANT (libero_scripted_gpu.sh
# configure), training, the evaluation of the last checkpoint STEP with EMA and raw weights (tasks 0-3 x standard
# init states 0-9, 8 actions per query, 4 solver steps), then the linear probe of the random and the trained VAE when
# the vision stage ran. For a machine set up by `libero_scripted_gpu.sh setup`, with data/libero_object/dataset
# carried or recorded. Log: runs/screen_VARIANT.log; results: runs/compare/VARIANT{ema8,raw8}/, runs/compare/probe/.
#
#   PROFILE=libero_object VARIANT=v4 TRAIN_SET="--set ..." [RECORD_SET="--set ..."] bash docs/archive/results/screen_row_gpu.sh STEP
# STEP: the checkpoint to evaluate, or `last` (the newest once training has ended). WEIGHTS: which to evaluate
# (default "ema raw"); TASKS and EPISODES: compare_queue.sh's.
set -uo pipefail
export PYTHONPATH=/tmp/libero/site:$PWD PYTHONUNBUFFERED=1
S=docs/archive/results/libero_scripted_gpu.sh
run=runs/${PROFILE:?}_${VARIANT:?}
step=${1:?checkpoint step or last}
if [[ -z "${SCREEN_DETACHED:-}" ]]; then
  mkdir -p runs
  SCREEN_DETACHED=1 setsid nohup bash "$0" "$@" >>"runs/screen_$VARIANT.log" 2>&1 </dev/null &
  echo "screen row $VARIANT in the background (pid $!); log: runs/screen_$VARIANT.log"
  exit 0
fi
if [[ -n "${RECORD_SET:-}" ]]; then
  echo "[$(date +%T)] record"
  # shellcheck disable=SC2086  # RECORD_SET is a list of words
  python3 -m dzmodel.cli stage fetch --profile "$PROFILE" $RECORD_SET || exit 1
fi
echo "[$(date +%T)] configure"
bash $S configure || exit 1
echo "[$(date +%T)] train"
python3 -m dzmodel.cli train --config "$run/train_config.json" >>"$run/train.log" 2>&1
tail -n 2 "$run/train.log"
if [[ $step == last ]]; then
  newest=$(find "$run/train/checkpoints" -maxdepth 2 -name COMPLETE -path '*/step_*' | sort | tail -n 1)
  [[ -n $newest ]] || { echo "no complete checkpoint in $run/train/checkpoints"; exit 1; }
  step=$((10#$(basename "$(dirname "$newest")" | sed 's/^step_//')))
  echo "last checkpoint: $step"
fi
echo "[$(date +%T)] evaluate"
jobs=()
for weights in ${WEIGHTS:-ema raw}; do jobs+=("eval:${VARIANT}${weights}8:$run/train:$step:$weights:fast:--actions-per-chunk 8"); done
bash docs/archive/results/compare_queue.sh "${jobs[@]}"
if [[ -f "runs/$PROFILE/vision/vae.safetensors" && ! -d runs/compare/probe ]]; then
  echo "[$(date +%T)] probe"
  python3 -m dzmodel.cli eval probe "data/$PROFILE/dataset" --embodiment libero_sim_small --vae random \
    --vae "runs/$PROFILE/vision/vae.safetensors" --preset small --device cuda --no-progress --out runs/compare/probe
fi
echo "[$(date +%T)] row done"
