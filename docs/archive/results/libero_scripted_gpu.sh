#!/usr/bin/env bash
# The libero_scripted profile on a GPU machine that has neither LIBERO nor the pipeline's services (the device
# image: Python 3.12, torch, safetensors, numpy, pyarrow, OpenCV; no package index). Run from the repo root.
#
#   setup              install the LIBERO bundle carried in .libero_bundle/ (`infra/libero_bundle.py`: the files of
#                      the profile's suite, e.g. `--suite spatial --tasks 0-9` for PROFILE=libero_spatial, and the
#                      mujoco and cffi wheels) and any wheels in .libero_bundle_extra/ (PyAV for the recorder's
#                      H.264), into /tmp/libero; then check that LIBERO imports
#   record WORKERS     the fetch stage (the scripted expert's recording, WORKERS env processes) and the metadata
#                      stage of the profile, then its train config ($TRAIN_SET: extra `--set train.K=V` words)
#   share-data FROM    this profile trains on profile FROM's recording (same fetch params): link the dataset,
#                      then `configure`
#   configure          the metadata stage, the vision stage (the VAE pretraining, unless runs/<profile>/vision
#                      already holds one: variants share it) and the train config, for a recording already in
#                      data/<profile>/ (e.g. carried); with VARIANT=NAME the run is runs/<profile>_NAME/ (another seed or setting via
#                      $TRAIN_SET, the same recording and metadata); train-bg, stop, eval and export take VARIANT too;
#                      STOP_AT=S stops training after step S on the same schedule
#   train-bg           start training (the train config above, resuming from the newest checkpoint) in the
#                      background, detached, so that it outlives this command; its log is runs/<profile>/train.log
#   wait SECONDS       follow the training log for at most SECONDS, or until training ends
#   stop               stop the background training (checkpoints are atomic: the newest saved one stays usable)
#   eval STEPS ARGS..  `dz eval libero` of the run's checkpoints STEPS (e.g. 1000,2000) on this GPU, with ARGS added
#   compare-bg JOB..   detached: the evaluations and previews JOB.. of the LoRA / full / EMA comparison, one after
#                      another, each once its checkpoints exist (docs/archive/results/compare_queue.sh says what a JOB is)
#   collect            what the comparison has written so far, as $OUT/compare.tar.gz (the device returns 8 files)
#   export STEPS [W]   the converted checkpoints STEPS (weights W: raw or ema) as tar parts of <= 15 MiB in $OUT (the
#                      device returns at most 16 MiB per file); with BF16=1 the model weights are rounded to bf16 (half
#                      the size; upcast_model.py restores an fp32 directory), by default they stay fp32
set -euo pipefail
export PYTHONPATH=/tmp/libero/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TQDM_MININTERVAL=10
export LIBERO_CONFIG_PATH=/tmp/libero/config MUJOCO_GL=egl
profile=${PROFILE:-libero_scripted}
run=runs/$profile${VARIANT:+_$VARIANT}
dz() { python3 -m dzmodel.cli "$@"; }
case "$1" in
  setup)
    bash .libero_bundle/install.sh /tmp/libero
    if compgen -G ".libero_bundle_extra/*.whl" >/dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/libero/site \
        .libero_bundle_extra/*.whl
    fi
    python3 -c 'from dzmodel.eval.libero_env import check_libero; print("LIBERO:", check_libero(deep=True))' ;;
  record)
    dz stage fetch --profile "$profile" --set "fetch.record.workers=$2"
    bash "$0" configure ;;
  share-data)
    mkdir -p data
    ln -sfn "$2" "data/$profile"
    bash "$0" configure ;;
  configure)
    dz stage metadata --profile "$profile"
    # shellcheck disable=SC2086  # TRAIN_SET is a list of words (`--set vision.enabled=false`: the seeded VAE)
    [ -f "runs/$profile/vision/vae.safetensors" ] || dz stage vision --profile "$profile" ${TRAIN_SET:-}
    # shellcheck disable=SC2086  # TRAIN_SET is a list of words
    dz params train-config --profile "$profile" --out "$run/train_config.json" ${TRAIN_SET:-}
    # params.yaml derives out_dir from the profile: point it at the variant's run; STOP_AT ends the run early on the
    # same LR schedule (the trainer's stop_at, which the pipeline leaves unset)
    python3 -c 'import json, sys; run, variant, stop_at = sys.argv[1:]; p = run + "/train_config.json"
c = json.load(open(p)); c["out_dir"] = run + "/train" if variant else c["out_dir"]
if variant and c.get("metadata"):  # its own copy, which a later variant leaves alone
    import shutil; shutil.copyfile(c["metadata"], run + "/metadata.json"); c["metadata"] = run + "/metadata.json"
c["stop_at"] = int(stop_at) if stop_at else c.get("stop_at"); json.dump(c, open(p, "w"), indent=1)
print("out_dir", c["out_dir"], "stop_at", c["stop_at"])' "$run" "${VARIANT:-}" "${STOP_AT:-}" ;;
  train-bg)
    mkdir -p "$run"
    setsid nohup python3 -m dzmodel.cli train --config "$run/train_config.json" >>"$run/train.log" 2>&1 </dev/null &
    echo "training in the background (pid $!); log: $run/train.log" ;;
  wait)
    end=$((SECONDS + $2))
    while ((SECONDS < end)) && pgrep -f "dzmodel.cli train|compare_queue" >/dev/null; do sleep 15; done
    for log in runs/*/train.log; do
      r=$(dirname "$log"); echo "== $r"
      grep -v -i warn "$log" | tail -3
      tail -n 1 "$r/train/metrics.jsonl" 2>/dev/null || true
      ls "$r/train/checkpoints" 2>/dev/null | tr '\n' ' '; echo
      cp "$r/train/metrics.jsonl" "$OUT/$(basename "$r")_metrics.jsonl" 2>/dev/null || true
    done
    if [[ -f runs/compare/log ]]; then tail -n 15 runs/compare/log; bash "$0" collect; fi ;;
  compare-bg)
    mkdir -p runs/compare
    shift
    setsid nohup bash docs/archive/results/compare_queue.sh "$@" >>runs/compare/log 2>&1 </dev/null &
    echo "comparison queued in the background (pid $!); log: runs/compare/log" ;;
  collect)
    (cd runs/compare && find . \( -path '*/converted*' -o -path './models' \) -prune -o \
       \( -name '*.csv' -o -name '*.json' -o -name '*.png' -o -name log \) -print) |
      { tar -C runs/compare --warning=no-file-changed -czf "$OUT/compare.tar.gz" -T - || (($? == 1)); } ;;  # 1: the log grew
  stop)
    pkill -TERM -f "dzmodel[.]cli train --config $run/train_config[.]json" || true  # this run only
    sleep 5
    ls "$run/train/checkpoints" ;;
  eval)
    steps=$2; shift 2
    dz eval libero "$run/train" --steps "$steps" --device cuda --no-progress --out "$run/eval" "$@"
    cp "$run/eval/results.csv" "$run/eval/episodes.csv" "$run/eval/per_episode.csv" "$run/eval/summary.json" "$OUT/" ;;
  export)
    weights=${3:-raw}
    for step in ${2//,/ }; do
      name=step_$(printf %07d "$step")
      python3 - "$run/train" "$name" "$weights" "${BF16:-0}" <<'PY'
import sys, torch
from pathlib import Path
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.model.state_dict import read_weights, save_safetensors_atomic
run, name, weights, bf16 = sys.argv[1:5]
out = Path("/tmp/export") / weights / name
convert_checkpoint(resolve_checkpoint(run, int(name.split("_")[1])), out, weights=weights)
if bf16 == "1":
    state = {k: v.to(torch.bfloat16) for k, v in read_weights(out).items()}
    (out / "model.safetensors").unlink()
    save_safetensors_atomic(state, out / "model.bf16.safetensors", {"format": "pt", "dtype": "bfloat16"})
PY
      tar -C "/tmp/export/$weights" -cf - "$name" | split -b 15M - "$OUT/${profile}_${weights}_$name.tar.part-"
    done
    ls -la "$OUT" ;;
  *) echo "usage: $0 setup | record WORKERS | share-data FROM | configure | train-bg | wait SECONDS | stop | eval STEPS [ARGS] |" \
          "compare-bg JOB.. | collect | export STEPS [raw|ema]" >&2
     exit 2 ;;
esac
