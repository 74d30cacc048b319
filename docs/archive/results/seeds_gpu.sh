#!/usr/bin/env bash
# Training seeds of the libero_object profile side by side, one GPU each, on one recording: the fetch stage once,
# then for every seed the stages after it (metadata, vision, cache, train, convert, eval, package) through
# `dz stage NAME` (docs/archive/results/profile_gpu.sh, detached and timed), each under its own root runs/seeds/seedN
# (`dz stage --root`) with the recording linked in. For a machine of several GPUs set up by
# `libero_scripted_gpu.sh setup` (with .libero_bundle_extra: the recorder's PyAV). Run from the repo root.
#
#   record              the fetch stage, every CPU core (detached; `wait` follows it)
#   start SEED:GPU ..   e.g. `start 1:0 2:1`, once the recording is done: each seed's stages on its GPU, the CPU
#                       cores split between them for the evaluation's env workers
#   wait SECONDS        follow them for at most SECONDS, or until all have ended
#   collect             each seed's stage timings, train metrics and evaluation files into $OUT (seedN_*)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
profile=${PROFILE:-libero_object}
pids() { cat runs/profile_"$profile"_*.pid 2>/dev/null; }
case "${1:-}" in
  record)
    STAGES=fetch TAG=record bash "$here/profile_gpu.sh" ;;
  start)
    shift
    [[ $# -gt 0 ]] || { echo "start SEED:GPU .." >&2; exit 2; }
    [[ -d data/$profile ]] || { echo "no recording in data/$profile: run \`$0 record\` first" >&2; exit 2; }
    workers=$(( $(nproc) / $# ))
    for spec in "$@"; do
      seed=${spec%%:*} gpu=${spec#*:}
      root=runs/seeds/seed$seed
      mkdir -p "$root/data"
      ln -sfn "$PWD/data/$profile" "$root/data/$profile"
      CUDA_VISIBLE_DEVICES=$gpu STAGES="metadata vision cache train convert eval package" TAG=seed$seed \
        bash "$here/profile_gpu.sh" --root "$root" --set "train.seed=$seed" --set "eval.workers=$workers"
    done ;;
  wait)
    end=$((SECONDS + ${2:?seconds}))
    while ((SECONDS < end)); do
      alive=0
      for pid in $(pids); do kill -0 "$pid" 2>/dev/null && alive=1; done
      ((alive)) || break
      sleep 10
    done
    for f in runs/profile_"$profile"_*.log; do
      echo "== $f"; grep -v -i warn "$f" | tail -n 4
    done
    cat runs/profile_"$profile"_*.jsonl 2>/dev/null ;;
  collect)
    for root in runs/seeds/seed*; do
      [[ -d $root ]] || continue
      name=$(basename "$root")
      cp "runs/profile_${profile}_$name.jsonl" "$OUT/${name}_stages.jsonl" 2>/dev/null
      cp "$root/runs/$profile/train/metrics.jsonl" "$OUT/${name}_train_metrics.jsonl" 2>/dev/null
      for f in summary.json per_episode.csv results.csv episodes.csv timing.json; do
        cp "$root/runs/$profile/eval/$f" "$OUT/${name}_$f" 2>/dev/null
      done
    done
    ls "$OUT" ;;
  *) echo "usage: $0 record | start SEED:GPU .. | wait SECONDS | collect" >&2; exit 2 ;;
esac
