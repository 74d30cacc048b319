#!/usr/bin/env bash
# The training-speed experiments of docs/performance.md at the libero_object shape (micro-batch 128, compiled
# blocks, the recording on the GPU), on the synthetic recording of that shape (`fastpath_gpu.sh synth`):
# `fastpath_gpu.sh phases` once (where the step's device time goes, every kernel in phases_kernels.csv), then
# `fastpath_gpu.sh measure` (STEPS steps, default 150) for each variant:
#   base    the code as it is
#   whole   upstream's whole sequence: the last clean block kept (PRELUDE=whole)
#   tiles2  Inductor's default tiling, not one tiled dimension (PRELUDE=tiles2; `dz train` checks compiled
#           against eager before it trains and stops if they differ)
#   cdt     Inductor's coordinate-descent tuning of its kernels (PRELUDE=cdt)
#   flash   SDPA's flash kernels instead of cuDNN's (PRELUDE=flash)
#   autotune  Inductor's max-autotune: Triton matmul templates, which can take the GELU and other elementwise work
#           into the matmul (PRELUDE=autotune; compiling takes minutes)
#   graphs  the compiled blocks as CUDA graphs (torch.compile's reduce-overhead mode, PRELUDE=graphs)
#   mb256   micro-batch 256; and combinations: graphsflash, mb256flash, mb256graphsflash
#   qk32    q and k promoted to fp32 by the norm's fp32 weight, as before round 14 (PRELUDE=qk32)
#   bf16res the residual stream between blocks in bf16, as inference with bf16 weights runs it (PRELUDE=bf16res)
#   (round 14 measured these three with train.cuda_graphs: `fastpath_gpu.sh measure ... cuda_graphs=true`)
#   mixorder  Inductor's mix-order reductions: a norm's backward and the sums for its weight and modulation
#           gradients in one kernel (PRELUDE=mixorder); aggressive: aggressive_fusion; combo: combo_kernels
#   fulllast  the last block over every row, as before round 15 (PRELUDE=fulllast; the code computes only the rows
#           the loss reads)
#   rope1   RoPE as before round 16, pairs selected and stacked (PRELUDE=rope1; the code now computes
#           x*cos + swap_pairs(x)*(-sin, sin), one pointwise kernel, the same numbers)
#   nof0    train.denoise_first_frame=false: no noisy copy of frame 0 (12 % fewer tokens; a change of recipe)
#   combo2  Inductor's combo kernels through the product's setting, train.compile_options (combo: the same through a
#           patch); res16combo2: and the residual stream in bf16
#   cdt2    Inductor's coordinate-descent tuning through train.compile_options (cdt: the same through a patch);
#           res16cdt2: and the residual stream in bf16; res16mb256: the bf16 stream at micro-batch 256
#           res16step: the same through the product's setting, train.compile_scope: step
#           res16whole: the whole forward and loss as one compiled graph, the blocks inline (PRELUDE=wholestep)
#           (res16mb192 at 192; res16mb256ew at 256 with the elementwise work recomputed in backward, less memory)
#   res16   train.residual_in_compute_dtype: the residual stream in bf16 (the setting, not a patch); res16agg and
#           res16combo: with aggressive fusion or combo kernels
# Detached, so it outlives one command:
#   start [VARIANT ..]  returns at once; default: phases base whole tiles2 cdt mb256. Finished ones are skipped.
#   run [VARIANT ..]    the same in the foreground
#   collect             the summaries so far, and copies the logs and metrics to $OUT
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=runs/speed_sweep
synth=data/fastpath_synth
common=(micro_batch=128 encoded_variants=1 compile=true ${SWEEP_EXTRA:-})  # e.g. SWEEP_EXTRA=cuda_graphs=true

# variant: PRELUDE (comma-separated, see fastpath_gpu.sh) | train fields
declare -A VARIANTS=(
  [base]="|" [whole]="whole|" [tiles2]="tiles2|" [cdt]="cdt|" [flash]="flash|" [autotune]="autotune|"
  [graphs]="graphs|" [graphsflash]="graphs,flash|" [graphscdt]="graphs,cdt|" [graphsautotune]="graphs,autotune|"
  [qk32]="qk32|" [bf16res]="bf16res|" [mixorder]="mixorder|" [aggressive]="aggressive|" [combo]="combo|"
  [bf16resmixorder]="bf16res,mixorder|" [fulllast]="fulllast|" [res16]="|residual_in_compute_dtype=true"
  [res16agg]="aggressive|residual_in_compute_dtype=true" [res16combo]="combo|residual_in_compute_dtype=true"
  [combo2]='|compile_options={"combo_kernels":true}'
  [res16combo2]='|compile_options={"combo_kernels":true} residual_in_compute_dtype=true'
  [cdt2]='|compile_options={"coordinate_descent_tuning":true}'
  [res16cdt2]='|compile_options={"coordinate_descent_tuning":true} residual_in_compute_dtype=true'
  [res16mb256]="|residual_in_compute_dtype=true micro_batch=256"
  [res16whole]="wholestep|residual_in_compute_dtype=true"
  [res16step]="|residual_in_compute_dtype=true compile_scope=step"
  [res16mb192]="|residual_in_compute_dtype=true micro_batch=192"
  [res16mb256ew]="|residual_in_compute_dtype=true micro_batch=256 activation_checkpointing=elementwise"
  [rope1]="rope1|" [nof0]="|denoise_first_frame=false" [nof0rope1]="rope1|denoise_first_frame=false"
  [mb256]="|micro_batch=256" [mb256flash]="flash|micro_batch=256" [mb256graphsflash]="graphs,flash|micro_batch=256"
)

one() {  # VARIANT, or VARIANT.N for a repeated row (its own run and log)
  local v=$1 key=${1%%.*}
  [[ -s $dir/$v.done ]] && return 0
  if [[ $v == phases ]]; then
    OUT=$dir bash "$here/fastpath_gpu.sh" phases "$synth" "${common[@]}" > "$dir/phases.log" 2>&1
  elif [[ -n ${VARIANTS[$key]+set} ]]; then
    local spec=${VARIANTS[$key]}
    PRELUDE=${spec%%|*} VARIANT=$v OUT=$dir bash "$here/fastpath_gpu.sh" measure "$synth" "${common[@]}" \
      ${spec#*|} > "$dir/$v.log" 2>&1
  else
    echo "unknown variant $v (known: phases ${!VARIANTS[*]})" >&2; return 2
  fi
  local rc=$?
  echo "rc $rc $(date -u +%FT%TZ)" > "$dir/$v.done"
}

case "${1:-}" in
  start)
    shift
    variants=("$@")
    [[ ${#variants[@]} -gt 0 ]] || variants=(phases base whole tiles2 cdt mb256)
    mkdir -p "$dir"
    export STEPS=${STEPS:-150}
    (
      [[ -d $synth ]] || bash "$here/fastpath_gpu.sh" synth > "$dir/synth.log" 2>&1
      for v in "${variants[@]}"; do one "$v"; done
      echo finished > "$dir/all.done"
    ) > /dev/null 2>&1 < /dev/null &
    disown
    echo "started: ${variants[*]} (logs in $dir)" ;;
  run)
    shift
    mkdir -p "$dir"
    export STEPS=${STEPS:-150}
    [[ -d $synth ]] || bash "$here/fastpath_gpu.sh" synth > "$dir/synth.log" 2>&1
    for v in "$@"; do one "$v"; echo "$v: $(cat "$dir/$v.done")"; done ;;
  collect)
    for f in "$dir"/*.log; do
      [[ -f $f ]] || continue
      echo "== $(basename "$f") $(cat "${f%.log}.done" 2>/dev/null || echo running)"
      grep -E "median|samples/s/GPU, step|device ms per step|kernel launches|whole step|encoders \+|Error|error:" "$f" | tail -6
    done
    tar -czf "${OUT:-/tmp}/speed_sweep.tar.gz" -C "$dir" $(cd "$dir" && ls *.log *.jsonl *.csv 2>/dev/null) ;;
  *) echo "usage: $0 start [VARIANT ..] | run [VARIANT ..] | collect" >&2; exit 2 ;;
esac
