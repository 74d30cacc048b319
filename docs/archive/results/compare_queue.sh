#!/usr/bin/env bash
# The LoRA / full / EMA comparison of docs/results.md section 7 on the GPU machine. Started detached by
# `libero_scripted_gpu.sh compare-bg JOB...`; each job starts once the checkpoints it needs are complete (or their
# training has ended), so evaluations overlap the trainings still running (a lease lasts 30 minutes). Each JOB is
#     eval:NAME:RUN:STEPS:WEIGHTS[:SOLVER[:ARGS]]
#                                            `dz eval libero` of RUN's checkpoints STEPS with WEIGHTS (raw|ema), LIBERO-
#                                            Object tasks $TASKS (default 0,1,2,3), standard init states
#                                            0..$EPISODES-1 (default 10); SOLVER: fast (4 steps, the profile's), fast8
#                                            or fast16 (8 or 16 steps), upstream or reference (16 steps with or without
#                                            upstream's DiT schedule); ARGS: more `dz eval libero` words, e.g.
#                                            "--context frame" or "--actions-per-chunk 8"
#     preview:NAME:RUN:STEP:WEIGHTS          the world model's predicted video of 4 windows beside the real frames
# Jobs run one after another, results land in runs/compare/<NAME>/ as soon as they exist, so put the most important
# first: a machine taken back mid-queue still leaves those (`libero_scripted_gpu.sh collect`).
set -uo pipefail
export PYTHONPATH=/tmp/libero/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TQDM_MININTERVAL=30
export LIBERO_CONFIG_PATH=/tmp/libero/config MUJOCO_GL=egl
dz() { python3 -m dzmodel.cli "$@"; }
out=runs/compare
declare -A solvers=([fast]="--solver-steps 4 --cfg-scale 1" [fast8]="--solver-steps 8 --cfg-scale 1"
                    [fast16]="--solver-steps 16 --cfg-scale 1" [upstream]="--solver-steps 16 --cfg-scale 1 --dit-steps upstream"
                    [reference]="--solver-steps 16 --cfg-scale 1 --dit-steps=")
# until every checkpoint in STEPS (comma-separated) of RUN is complete, or no training is running any more
wait_for() {
  local run=$1 step
  for step in ${2//,/ }; do
    while [[ ! -f "$run/checkpoints/step_$(printf %07d "$step")/COMPLETE" ]] && pgrep -f "dzmodel[.]cli train" >/dev/null
    do sleep 10; done
  done
}
for job in "$@"; do
  IFS=: read -r kind name run steps weights solver extra <<<"$job"
  read -r -a args <<<"${solvers[${solver:-fast}]} ${extra:-}"
  wait_for "$run" "$steps"
  echo "[$(date +%T)] $job"
  case $kind in
    eval)
      dz eval libero "$run" --steps "$steps" --weights "$weights" --suite object --tasks "${TASKS:-0,1,2,3}" \
        --episodes "${EPISODES:-10}" --workers 15 --camera-size 128 --videos 1 --device cuda --no-progress \
        --out "$out/$name" "${args[@]}" | tail -n 7 ;;
    preview)
      dz convert "$run" --step "$steps" --weights "$weights" --out "$out/models/$name" >/dev/null &&
        dz eval previews "$out/models/$name" --out "$out/previews/$name" --windows 4 --device cuda "${args[@]}" |
        tail -n 1 ;;
    *) echo "unknown job kind $kind" ;;
  esac
done
echo "[$(date +%T)] done"
