#!/usr/bin/env bash
# FP8 against bf16 on one GPU, side by side in one call, through the commands users run. Run from the repo root on
# the device machine; JSON lines go to $OUT (plot the parity run here with `python docs/archive/bench/loss_parity.py`).
# PART names one part or several, comma-separated, run in order in one call (PART=train,loader):
#   PART=train   `dz train` at the 5B DROID shape (the cache of docs/archive/bench/train_vs_bench_run.sh, micro-batch 21,
#                compiled, elementwise recompute): STEPS (default 12) steps in bf16, then the same in fp8
#                (TRAIN_PRECISIONS, default "bf16 fp8"), then, where FP8_BF16_LAYERS is set (a JSON list:
#                '["self_attn.o","cross_attn"]'), in fp8 with those linears bf16, then, for each micro-batch of
#                FP8_KEEP_INPUTS_MB ("21 18", or MB:MODE, "21:wide"), in fp8 with train.fp8_keep_inputs (true, or
#                MODE), then, for each of FP8_VARIANTS ("keep_weights clip_apart", A+B for both), in fp8 with that
#                version of docs/archive/bench/fp8_backward_variants.py in place
#                TRAIN_SET ("residual_in_compute_dtype=true") adds settings to every run of this part and of parity
#   PART=parity  the same seed and data for PARITY_STEPS (default 500) steps at micro-batch PARITY_MB (default 4),
#                for each of PARITY_PRECISIONS (default "bf16 fp8"), in order; no checkpoints (a 5B one with its AdamW
#                state is about 60 GB), so a run must finish within its call: name one precision per call if need be.
#                The data: 64 learnable synthetic samples (`dz cache --synthetic --learnable`: actions a fixed function
#                of frame 0 and the state), scored every 100 steps on 16 held-out samples of another seed
#                (`train.val_cache`: val_action_loss); PARITY_PROMPT_TOKENS=T: both caches' prompts zero past their
#                length (the longest T rows), so the runs leave the text's padding rows out of the projections
#   PART=policy  `dz bench policy --precision fp8` for the 5B and the 14B at the deployed setting (16 steps, DiT
#                caching, CFG 5, CUDA graphs, compile), batches 1 and 4: bf16 and FP8 rows with their chunk difference
#   PART=14b     FSDP2 over every GPU of the machine: `dz bench train` slices of the 14B (LAYERS_14B, default "8 16"
#                layers, DROID's 44x80 latent, micro-batch 1, compiled, elementwise recompute), bf16 and fp8; project
#                the full preset here with `python docs/archive/bench/project_14b.py $OUT/train_14b_fp8_slices_*.jsonl`.
#                On one GPU the slices have no FSDP2 communication: their projection is the compute alone
#   PART=tail    the 5B at the deployed setting, bf16, TAIL_CALLS (default 100) timed calls, without and then with
#                the heap frozen after the warm-up (`--gc-freeze`, as dz serve does): every call's time in order and
#                what the timed calls paid for (garbage collections, new device memory, CUDA-graph captures)
#   PART=profile where a 5B step's GPU time goes, bf16 then fp8 (`dz bench profile`: PROFILE_LAYERS (default 4) of the
#                30 layers, micro-batch 21, compiled, elementwise recompute; kernels by category and the top 20), and
#                each linear layer of a block alone, forward + backward, bf16 against the FP8 layer (`--linears`)
#   PART=video   `dz train` of the 5B from the loader part's DROID-shaped recording, frames decoded by NVDEC, the
#                frozen encoders in the step, fp8, VIDEO_STEPS (12) steps at micro-batch VIDEO_MB (2), laid out by
#                VIDEO_EMBODIMENT (oxe_droid_5b: the 5B's 176x320 frame; oxe_droid: 352x640). Carry build/bench_data
#                and .nvdec_wheels, as for the loader part
#   PART=variants versions of the FP8 linear's backward in the same 4-layer step, one process each
#                (docs/archive/bench/fp8_backward_variants.py; BACKWARD_VARIANTS, default "library:0 library weight_inline":
#                NAME:0 with the linears' e4m3 inputs recomputed, not kept (train.fp8_keep_inputs))
#   PART=loader  `dz bench data --trainer-loader` on this machine's cores at the 5B DROID shape, the videos decoded by
#                the loader workers (cpu) and then by the GPU (nvdec) (LOADER_DECODE, default "cpu nvdec"),
#                LOADER_WORKERS (default 0,2,4) workers each, nvdec on NVDEC_THREADS (default 4,8) decoding threads
#                (train.nvdec_threads); LOADER_BATCHES (default 30) timed micro-batches of LOADER_MB (default 2);
#                LOADER_EMBODIMENT (default oxe_droid; oxe_droid_5b: the 5B's 176x320 frame).
#                Carry build/bench_data (the DROID-shaped recording, written here by one CPU run of the same
#                command: the GPU image cannot encode H.264) and .nvdec_wheels (the pynvvideocodec wheel, cp312)
set -euo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
PART=${PART:-train}
WORK=${WORK:-build/fp8}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
echo "$GPU torch $(python -c 'import torch; print(torch.__version__)')"
mkdir -p "$WORK"
dz() { python -m dzmodel.cli "$@"; }
# PROMPT_TOKENS=T: the train part's cache has prompts of up to T tokens, zero past their length as umT5 leaves them
# (`dz cache --prompt-tokens`); by default every one of the 512 text rows is random
CACHE_5B=$WORK/cache_5b${PROMPT_TOKENS:+_prompts$PROMPT_TOKENS}
cache() {
  [ -d "$CACHE_5B" ] || dz cache --synthetic 64 --preset dreamzero_5b --latent-hw 11,20 --out "$CACHE_5B" \
    ${PROMPT_TOKENS:+--prompt-tokens "$PROMPT_TOKENS"}
}
learnable() {  # DIR SAMPLES SEED (PARITY_PROMPT_TOKENS=T: prompts zero past their length, as PROMPT_TOKENS)
  [ -d "$WORK/$1" ] || dz cache --synthetic "$2" --learnable --set seed="$3" --preset dreamzero_5b --latent-hw 11,20 \
    --out "$WORK/$1" ${PARITY_PROMPT_TOKENS:+--prompt-tokens "$PARITY_PROMPT_TOKENS"}
}
train_5b() {  # NAME PRECISION STEPS MICRO_BATCH SAVE_EVERY [--set K=V ..]
  local name=$1 precision=$2 steps=$3 mb=$4 save=$5
  shift 5
  dz train --preset dreamzero_5b --steps "$steps" --out "$WORK/$name" --set cache="${CACHE:-$CACHE_5B}" \
    --set micro_batch="$mb" \
    --set global_batch="$mb" --set compile=true --set activation_checkpointing=elementwise --set attn_backend=segments \
    --set precision="$precision" --set num_workers=2 --set save_every="$save" --set progress=false --set seed=0 \
    "${extra_sets[@]}" "$@"
}
extra_sets=()  # TRAIN_SET="K=V K=V": more train settings for every dz train of the train and parity parts
for kv in ${TRAIN_SET:-}; do extra_sets+=(--set "$kv"); done
for part in ${PART//,/ }; do  # PART=train,loader: several parts in one call, in order
case "$part" in
  train)
    cache
    for p in ${TRAIN_PRECISIONS:-bf16 fp8}; do
      rm -rf "$WORK/speed_$p"
      train_5b "speed_$p" "$p" "${STEPS:-12}" 21 0 2>&1 | tee "$OUT/train_5b_${p}_$GPU.log" | tail -3
      cp "$WORK/speed_$p/metrics.jsonl" "$OUT/train_5b_${p}_$GPU.jsonl"
    done
    if [ -n "${FP8_BF16_LAYERS:-}" ]; then
      rm -rf "$WORK/speed_fp8_kept"
      train_5b speed_fp8_kept fp8 "${STEPS:-12}" 21 0 --set fp8_bf16_layers="$FP8_BF16_LAYERS" 2>&1 \
        | tee "$OUT/train_5b_fp8_kept_$GPU.log" | tail -3
      cp "$WORK/speed_fp8_kept/metrics.jsonl" "$OUT/train_5b_fp8_kept_$GPU.jsonl"
    fi
    for entry in ${FP8_KEEP_INPUTS_MB:-}; do  # MB or MB:MODE: fp8 with train.fp8_keep_inputs MODE (true; wide)
      mb=${entry%%:*} mode=true
      [[ $entry == *:* ]] && mode=${entry#*:}
      name=speed_fp8_inputs_${mode}_mb$mb
      rm -rf "${WORK:?}/$name"
      train_5b "$name" fp8 "${STEPS:-12}" "$mb" 0 --set fp8_keep_inputs="$mode" 2>&1 \
        | tee "$OUT/train_5b_fp8_keep_inputs_${mode}_mb${mb}_$GPU.log" | tail -3 || true
      cp "$WORK/$name/metrics.jsonl" "$OUT/train_5b_fp8_keep_inputs_${mode}_mb${mb}_$GPU.jsonl" || true
    done
    for v in ${FP8_VARIANTS:-}; do  # dz train in fp8 with a version of docs/archive/bench/fp8_backward_variants.py
      f=${v//+/_and_}  # A+B: the device's file names take no '+'
      rm -rf "$WORK/speed_fp8_$f"
      dz() { python docs/archive/bench/fp8_backward_variants.py "$v" "$@"; }
      train_5b "speed_fp8_$f" fp8 "${STEPS:-12}" 21 0 2>&1 | tee "$OUT/train_5b_fp8_${f}_$GPU.log" | tail -3 || true
      cp "$WORK/speed_fp8_$f/metrics.jsonl" "$OUT/train_5b_fp8_${f}_$GPU.jsonl" || true
      dz() { python -m dzmodel.cli "$@"; }
    done ;;
  video)
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/nvdec .nvdec_wheels/*.whl
    emb=${VIDEO_EMBODIMENT:-oxe_droid_5b}
    PYTHONPATH=$PYTHONPATH:/tmp/nvdec dz bench data --trainer-loader --workdir build/bench_data --video-decode nvdec \
      --workers 0 --decode-threads 8 --batches 12 --micro-batch 21 --embodiment "$emb" \
      --out "$OUT/loader_droid_${emb}_$GPU.jsonl" || true
    meta=$(python -c 'import sys, pathlib; from dzmodel.bench.loader_bench import metadata_path
print(metadata_path(pathlib.Path(sys.argv[1]), sys.argv[2]))' build/bench_data/droid_h264_g2 "$emb")
    rm -rf "$WORK/video_$emb"
    PYTHONPATH=$PYTHONPATH:/tmp/nvdec dz train --preset dreamzero_5b --steps "${VIDEO_STEPS:-12}" --out "$WORK/video_$emb" \
      --set datasets='["build/bench_data/droid_h264_g2"]' --set embodiment="$emb" --set metadata="$meta" \
      --set tokenizer=build/bench_data/tokenizer --set micro_batch="${VIDEO_MB:-2}" --set global_batch="${VIDEO_MB:-2}" \
      --set video_decode=nvdec --set nvdec_threads=8 --set num_workers=2 --set compile=true \
      --set activation_checkpointing=elementwise --set attn_backend=segments --set precision=fp8 --set save_every=0 \
      --set progress=false --set seed=0 2>&1 | tee "$OUT/train_5b_video_${emb}_mb${VIDEO_MB:-2}_$GPU.log" | tail -3 || true
    cp "$WORK/video_$emb/metrics.jsonl" "$OUT/train_5b_video_${emb}_mb${VIDEO_MB:-2}_$GPU.jsonl" || true ;;
  parity)
    tag=${PARITY_PROMPT_TOKENS:+_prompts$PARITY_PROMPT_TOKENS}
    learnable "parity_train$tag" 64 0
    learnable "parity_heldout$tag" 16 1
    for p in ${PARITY_PRECISIONS:-bf16 fp8}; do
      rm -rf "$WORK/parity_$p"
      CACHE=$WORK/parity_train$tag train_5b "parity_$p" "$p" "${PARITY_STEPS:-500}" "${PARITY_MB:-4}" 0 \
        --set val_cache="$WORK/parity_heldout$tag" --set val_every=100 2>&1 | tail -3
      cp "$WORK/parity_$p/metrics.jsonl" "$OUT/parity_5b_${p}${tag}_$GPU.jsonl"
    done ;;
  policy)
    for preset in dreamzero_5b dreamzero_14b; do
      dz bench policy --preset "$preset" --device cuda --dit-steps upstream --compile --batch 1,4 --calls 20 \
        --precision fp8 --out "$OUT/policy_fp8_${preset}_$GPU.jsonl"
    done ;;
  14b)
    n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
    for layers in ${LAYERS_14B:-8 16}; do
      NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node "$n" --master_addr 127.0.0.1 --master_port 29541 -m dzmodel.cli \
        bench train --preset dreamzero_14b --layers "$layers" --latent-hw 44,80 --steps 3 --warmup 2 --no-baseline \
        --variant name=bf16,mbs=1,compile=1,ac=elementwise,attn=segments \
        --variant name=fp8,mbs=1,compile=1,ac=elementwise,attn=segments,prec=fp8 \
        --out "$OUT/train_14b_fp8_slices_${n}x$GPU.jsonl" 2>&1 | grep -v -i warn | tail -4
    done ;;
  tail)
    for freeze in "" --gc-freeze; do
      dz bench policy --preset dreamzero_5b --device cuda --dit-steps upstream --compile --calls "${TAIL_CALLS:-100}" \
        --warmup 5 --breakdown-calls 0 --name "deploy${freeze:+, heap frozen}" $freeze --out "$OUT/policy_tail_5b_$GPU.jsonl" \
        | python -c 'import json, sys
for line in sys.stdin:
    r = json.loads(line); print(r["name"], r.get("p50_ms"), r.get("p95_ms"), r.get("max_ms"), r.get("gc_pauses"), r.get("new_memory_segments"), r.get("graph_captures_timed"), r.get("error", ""))'
    done ;;
  profile)
    for p in bf16 fp8; do
      extra=()
      [ "$p" = bf16 ] && extra=(--linears)  # the layers alone once: they do not depend on the step's precision
      dz bench profile --preset dreamzero_5b --layers "${PROFILE_LAYERS:-4}" --latent-hw 11,20 "${extra[@]}" \
        --variant "name=$p,mbs=21,compile=1,ac=elementwise,attn=segments,prec=$p" \
        --out "$OUT/profile_5b_fp8_$GPU.jsonl" 2>&1 | grep -v -i warn
    done ;;
  variants)
    for v in ${BACKWARD_VARIANTS:-library:0 library weight_inline}; do  # NAME or NAME:KEEP_INPUTS (default 1)
      python docs/archive/bench/fp8_backward_variants.py "${v%%:*}" "${PROFILE_LAYERS:-4}" "$([[ $v == *:* ]] && echo "${v#*:}" || echo 1)" 2>&1 \
        | grep -v -i warn
    done ;;
  loader)
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/nvdec .nvdec_wheels/*.whl
    for decode in ${LOADER_DECODE:-cpu nvdec}; do
      PYTHONPATH=$PYTHONPATH:/tmp/nvdec dz bench data --trainer-loader --workdir build/bench_data --video-decode "$decode" \
        --workers "${LOADER_WORKERS:-0,2,4}" --decode-threads "${NVDEC_THREADS:-4,8}" \
        --batches "${LOADER_BATCHES:-30}" --micro-batch "${LOADER_MB:-2}" --embodiment "${LOADER_EMBODIMENT:-oxe_droid}" \
        --out "$OUT/loader_droid_$GPU.jsonl" || true
    done
    echo "cores: $(nproc)" ;;
  *) echo "PART must be train, parity, policy, 14b, tail, profile, variants, loader or video (or several, comma-separated)" >&2
     exit 2 ;;
esac
done
