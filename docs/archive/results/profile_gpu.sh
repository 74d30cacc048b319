#!/usr/bin/env bash
# The libero_object profile as the pipeline runs it, stage by stage through `dz stage NAME` (what the Prefect flow
# and dvc.yaml call; the device image has neither Prefect nor MLflow, so promotion is left out), detached so that it
# outlives the command that starts it, each stage timed. For a machine set up by `libero_scripted_gpu.sh setup`
# (with .libero_bundle_extra: the recorder's PyAV). A stage that finished in an earlier start on this machine (its
# line in the .jsonl) is skipped, and training resumes from its newest checkpoint, so a second start after a kill
# goes on where the first stopped.
# Log: runs/profile_libero_object.log; one JSON line per stage with its seconds: runs/profile_libero_object.jsonl
# (runs/profile_libero_object_$TAG.* with TAG set).
#
#   bash docs/archive/results/profile_gpu.sh [--set K=V ..]          # SETS are passed to every stage
#   bash docs/archive/results/profile_gpu.sh wait SECONDS             # follow it for at most SECONDS, or until it ends
#   bash docs/archive/results/profile_gpu.sh hand-over                # what a second machine needs for the stages after
#                                                             # convert, as tar parts in $OUT (16 MiB a file)
# A machine is held for at most 30 minutes: the stages up to convert run on one, `hand-over` brings back the last
# converted checkpoint, the VAE, the metadata and the timings, and a second machine, set up the same way, runs
# `STAGES="eval package"` with them unpacked (`cat profile_handover.tar.part-* | tar -x`).
set -uo pipefail
export PYTHONPATH=/tmp/libero/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TQDM_MININTERVAL=30
export LIBERO_CONFIG_PATH=/tmp/libero/config MUJOCO_GL=egl
profile=${PROFILE:-libero_object}
log=runs/profile_$profile${TAG:+_$TAG}   # TAG: several profiles on one machine (docs/archive/results/seeds_gpu.sh)
case "${1:-}" in
  wait)
    end=$((SECONDS + ${2:?seconds}))
    while ((SECONDS < end)) && kill -0 "$(cat "$log.pid" 2>/dev/null)" 2>/dev/null; do sleep 10; done
    grep -v -i warn "$log.log" | tail -n 12
    cat "$log.jsonl" 2>/dev/null
    exit 0 ;;
  hand-over)
    last=$(find "runs/$profile/converted" -maxdepth 1 -name 'step_*' | sort | tail -n 1)
    [[ -n $last ]] || { echo "no converted checkpoint under runs/$profile/converted"; exit 1; }
    tar -cf - "$last" "runs/$profile/vision" "runs/$profile/metadata" "runs/$profile/train_config.json" \
      "runs/$profile/train/metrics.jsonl" "$log.log" "$log.jsonl" | split -b 15M - "$OUT/profile_handover.tar.part-"
    ls -la "$OUT"
    exit 0 ;;
esac
if [[ -z "${PROFILE_DETACHED:-}" ]]; then
  mkdir -p runs
  PROFILE_DETACHED=1 setsid nohup bash "$0" "$@" >>"$log.log" 2>&1 </dev/null &
  echo $! >"$log.pid"
  echo "profile $profile in the background (pid $!); log: $log.log"
  exit 0
fi
start=$SECONDS
for stage in ${STAGES:-fetch metadata vision cache train convert eval package}; do
  if grep -q "\"stage\": \"$stage\"" "$log.jsonl" 2>/dev/null; then echo "$stage: done in an earlier start"; continue; fi
  t0=$SECONDS
  echo "[$(date +%T)] $stage"
  python3 -m dzmodel.cli stage "$stage" --profile "$profile" "$@" || { echo "stage $stage failed"; exit 1; }
  printf '{"stage": "%s", "seconds": %d, "since_start": %d}\n' "$stage" $((SECONDS - t0)) $((SECONDS - start)) \
    >>"$log.jsonl"
done
echo "[$(date +%T)] all stages in $((SECONDS - start)) s"
