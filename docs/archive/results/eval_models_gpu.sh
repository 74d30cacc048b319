#!/usr/bin/env bash
# The final recipe's evaluation of exported models (libero_scripted_gpu.sh export with BF16=1, carried), detached so
# that it outlives the command that starts it: each MODEL:NAME in turn, all 10 LIBERO-Object tasks, standard init
# states FIRST..FIRST+EPISODES-1, 8 actions per query, 4 solver steps, no guidance, no videos. For a machine set up
# by `libero_scripted_gpu.sh setup`. Log: runs/final_eval.log; results: runs/final/NAME/ (per_episode.csv etc.).
#
#   FIRST=10 EPISODES=40 bash docs/archive/results/eval_models_gpu.sh runs/a10eval/ema:seed0 runs/a10s1eval/ema:seed1
set -uo pipefail
export PYTHONPATH=/tmp/libero/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TQDM_MININTERVAL=30
export LIBERO_CONFIG_PATH=/tmp/libero/config MUJOCO_GL=egl
if [[ -z "${EVAL_DETACHED:-}" ]]; then
  mkdir -p runs
  EVAL_DETACHED=1 setsid nohup bash "$0" "$@" >>runs/final_eval.log 2>&1 </dev/null &
  echo "evaluations in the background (pid $!); log: runs/final_eval.log"
  exit 0
fi
for job in "$@"; do
  model=${job%%:*} name=${job#*:}
  [[ -f $model/model.bf16.safetensors ]] && python3 docs/archive/results/upcast_model.py "$model"
  echo "[$(date +%T)] $name: $model, init states ${FIRST:-0}..$((${FIRST:-0} + ${EPISODES:-50} - 1))"
  python3 -m dzmodel.cli eval libero "$model" --suite object --tasks "${TASKS:-0,1,2,3,4,5,6,7,8,9}" \
    --first-init-state "${FIRST:-0}" --episodes "${EPISODES:-50}" --workers "${WORKERS:-15}" --camera-size 128 \
    --actions-per-chunk 8 --solver-steps 4 --cfg-scale 1 --videos 0 --device cuda --no-progress \
    --out "runs/final/$name" | tail -n 3
done
echo "[$(date +%T)] done"
