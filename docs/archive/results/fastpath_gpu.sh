#!/usr/bin/env bash
# Throughput of `dz train` on the device-resident data path (train.data_on_device, docs/training.md) at the
# libero_scripted shape: the small preset with 1x1 patches, two 128 px views side by side (128x256 frames), 16-action
# chunks, 2 blocks per window (1 + 16 video frames), micro-batch 32, bf16, augmentation on, compiled blocks. For a GPU
# machine with the device image (Python 3.12, torch, numpy, pyarrow, PyYAML, OpenCV; no PyAV, torchcodec, lerobot,
# prefect or mlflow). Run from the repo root.
#
#   synth [EPISODES] [LENGTH]  a synthetic recording at that shape in data/fastpath_synth (`dz data synth`: two 128 px
#                              views, 8-dim state, 7-dim actions, orbit motion; MPEG-4 through OpenCV where PyAV is
#                              missing), default 60 episodes of 160 frames
#   measure DATASET [K=V ..]   `dz train` with the libero_scripted train config plus data_on_device, compile, STEPS steps
#                              (default 300), no checkpoints, metrics every LOG_EVERY (default 25) steps, on DATASET (a
#                              carried recording, e.g. data/libero_scripted/<its fetch dir>, or data/fastpath_synth).
#                              K=V words override train fields (JSON values), e.g. micro_batch=128 (global_batch
#                              follows unless given), compile=false, augment=false, or data_on_device=false
#                              num_workers=12 frame_cache_mib=4096 for the CPU loader it replaces. Prints the median
#                              samples/s/GPU, step time and MFU over the logged windows after the first WARM_ROWS
#                              (default 2: compile and warm-up), and copies the metrics and the log to $OUT. The run is
#                              runs/fastpath/$VARIANT (default "default"), started fresh
#   synccheck DATASET [K=V ..] 20 steps with torch.cuda.set_sync_debug_mode("warn") from the 4th step on: prints each
#                              place in dzmodel that makes the host wait for the GPU, with its count (expected: only
#                              the trainer's metrics read-back, once per LOG_EVERY steps)
#   phases DATASET [K=V ..]    30 steps, each phase timed with a device sync around it (the micro-batch gather and
#                              augmentation, the frozen encoders, the model's forward and backward, clipping + AdamW +
#                              EMA), then 3 steps under torch.profiler: kernel launches per step and the top kernels by
#                              device time; where a step's fixed cost goes (the syncs slow it: not a throughput figure)
#   all                        synth, then measure on it
set -euo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PRELUDE=${PRELUDE:-}
OUT=${OUT:-/tmp}
run=runs/fastpath/${VARIANT:-default}
synth=data/fastpath_synth
dz() { python3 -m dzmodel.cli "$@"; }
# PRELUDE=NAME: `measure` runs `dz train` after one of these patches (experiments; the product has no such switch)
prelude_code() {  # PRELUDE: names, comma-separated
  local name
  for name in ${PRELUDE//,/ }; do PRELUDE_ONE=$name prelude_one || return 2; done
}
prelude_one() {
  case "$PRELUDE_ONE" in
    whole) echo "import functools, dzmodel.model.wam as w, dzmodel.train.step as s, dzmodel.model.args as a, dzmodel.model.attention as m
f = functools.partial(m.latent_layout, keep_last_clean_block=True)
w.latent_layout = s.latent_layout = f" ;;
    tiles2) echo "import dzmodel.model.compile_compat as c; c.single_tile_dimension = lambda: None
import dzmodel.train.parallelize" ;;
    cdt) echo "import torch._inductor.config as i; i.coordinate_descent_tuning = True" ;;
    flash) echo "import torch; torch.backends.cuda.enable_cudnn_sdp(False)" ;;
    autotune) echo "import torch._inductor.config as i; i.max_autotune = True; i.max_autotune_gemm_backends = 'ATEN,TRITON'" ;;
    graphs) echo "import torch
_compile = torch.compile
def _graphed(model=None, **kwargs):  # the blocks as CUDA graphs (cudagraph trees)
    kwargs.setdefault('mode', 'reduce-overhead')
    return _compile(model, **kwargs) if model is not None else _compile(**kwargs)
torch.compile = _graphed" ;;
    mixorder) echo "import torch._inductor.config as i  # a norm's backward and its weight/modulation sums in one kernel
i.triton.mix_order_reduction = True
if hasattr(i.triton, 'mix_order_reduction_allow_multi_stages'): i.triton.mix_order_reduction_allow_multi_stages = True" ;;
    aggressive) echo "import torch._inductor.config as i; i.aggressive_fusion = True" ;;
    rope1) echo "import torch, dzmodel.model.wan_dit as w
def _apply(self, x):  # RoPE as before round 16: pairs selected, rotated and stacked
    B, L, H, D = x.shape
    xf = x.float().reshape(B, L, H, D // 2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = self.cos[None, :, None, :], self.sin[None, :, None, :]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).type_as(x)
w.Rope.apply = _apply" ;;
    fulllast) echo "import dzmodel.model.wam as w; w.narrows_queries = lambda mask: False  # the last block over every row" ;;
    combo) echo "import torch._inductor.config as i; i.combo_kernels = True" ;;
    qk32) echo "import torch, dzmodel.model.wan_dit as w
def _norm(self, x):  # the norm before q and k kept the input's dtype: fp32 q and k under autocast
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight
w.WanRMSNorm.forward = _norm" ;;
    bf16res) echo "import torch, dzmodel.model.wam as m
_embed = m.DreamZeroWAM.embed_register
def _register(self, *args):  # the register in the compute dtype: the residual stream between blocks is bf16
    out = _embed(self, *args)
    return out.to(torch.get_autocast_dtype('cuda')) if torch.is_autocast_enabled('cuda') else out
m.DreamZeroWAM.embed_register = _register" ;;
    wholestep) echo "import torch, dzmodel.train.step as s, dzmodel.train.parallelize as p
# the model's whole forward and the loss as one compiled graph (CUDA graphs: one forward and one backward), the
# blocks traced inline, instead of eight compiled blocks between eager embeddings, head and loss
_eager, _compiled = [False], {}
_blocks = p.eager_blocks
class _marked:
    def __init__(self, model): self.inner = _blocks(model)
    def __enter__(self): _eager[0] = True; return self.inner.__enter__()
    def __exit__(self, *exc): _eager[0] = False; return self.inner.__exit__(*exc)
p.eager_blocks = _marked  # TrainStep.eager looks it up at each call
def _core(step, inputs, mask, latents, noise, rest):
    out = step.model(*(inputs[k] for k in s.FORWARD_POSITIONAL), y=inputs['y'], mask=mask,
                     residual_dtype=step.residual_dtype, noisy_first_frame=step.denoise_first_frame)
    first = 0 if step.denoise_first_frame else 1
    actions, noise_a, ids, aids, action_mask, has_real_action = rest
    l = s.flow_matching_losses(step.schedule, out.video_pred, out.action_pred, latents[:, :, first:],
                               noise[:, :, first:], actions, noise_a, ids[:, first:], aids, action_mask,
                               has_real_action)
    return l.loss, l.dynamics_loss, l.action_loss
def _losses(self, batch):
    inputs, (latents, noise, *rest) = self.noised(batch)
    mask = self.mask(latents.shape)
    if _eager[0]:
        return s.Losses(*_core(self, inputs, mask, latents, noise, rest))
    if 'fn' not in _compiled:
        _compiled['fn'] = torch.compile(_core, mode='reduce-overhead' if latents.is_cuda else None)
    with _blocks(self.model):  # the compiled graph traces the blocks' own code
        return s.Losses(*_compiled['fn'](self, inputs, mask, latents, noise, tuple(rest)))
s.TrainStep.losses = _losses" ;;
    *) echo "unknown PRELUDE $PRELUDE_ONE" >&2; return 2 ;;
  esac
}
train_with_prelude() {  # CONFIG
  local code
  code=$(prelude_code) || exit 2
  python3 - "$1" <<PY
$code
import sys
from dzmodel.cli import main
sys.exit(main(["train", "--config", sys.argv[1]]))
PY
}

configure() {  # DATASET STEPS [K=V ..]: $run/metadata.json and $run/train_config.json
  local dataset=$1 steps=$2
  shift 2
  [[ -d "$dataset" || $dataset == s3://* ]] || { echo "no dataset directory $dataset" >&2; exit 2; }
  rm -rf "$run"
  mkdir -p "$run"
  # an s3:// dataset takes its statistics from a local copy (METADATA_DATASET): `dz data metadata` reads every file
  dz data metadata "${METADATA_DATASET:-$dataset}" --embodiment libero_sim_small --out "$run/metadata.json" >/dev/null
  dz params train-config --profile libero_scripted --out "$run/train_config.json" >/dev/null
  python3 - "$run" "$dataset" "$steps" "${LOG_EVERY:-25}" "$@" <<'PY'
import json, sys
run, dataset, steps, log_every, *pairs = sys.argv[1:]
path = run + "/train_config.json"
c = json.load(open(path))
c.update(datasets=[dataset], metadata=run + "/metadata.json", out_dir=run + "/train", data_on_device=True,
         compile=True, encoder_weights={}, steps=int(steps), save_every=0, log_every=int(log_every), progress=False)
given = {}
for pair in pairs:
    key, _, value = pair.partition("=")
    try:
        given[key] = json.loads(value)
    except ValueError:
        given[key] = value
if "micro_batch" in given and "global_batch" not in given:
    given["global_batch"] = given["micro_batch"]
c.update(given)
json.dump(c, open(path, "w"), indent=1)
print("train config:", {k: c[k] for k in ("preset", "model_overrides", "micro_batch", "global_batch", "precision",
      "compile", "data_on_device", "augment", "num_workers", "attn_backend", "steps", "log_every")})
PY
}

summary() {  # the logged windows after the warm-up: median samples/s/GPU, step time, MFU
  python3 - "$run/train/metrics.jsonl" "${WARM_ROWS:-2}" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
rows = rows[int(sys.argv[2]):] or rows
med = lambda key: statistics.median(r[key] for r in rows) if all(key in r for r in rows) else None
sps, mfu = med("samples_per_s_per_gpu"), med("mfu")
print(f"steps {rows[0]['step']}-{rows[-1]['step']} ({len(rows)} logged windows): median {sps:.1f} samples/s/GPU, "
      f"step {1000 * med('step_time_s'):.1f} ms, MFU {'n/a' if mfu is None else f'{100 * mfu:.2f} %'}, "
      f"peak {max(r['peak_mem_gib'] for r in rows):.1f} GiB, loss {rows[-1]['loss']:.4f}")
PY
}

case "${1:-}" in
  synth)
    dz data synth "$synth" --episodes "${2:-60}" --length "${3:-160}" --image-size 128 --codec h264 --motion orbit \
      --seed 0 --overwrite ;;
  measure)
    dataset=$2
    shift 2
    configure "$dataset" "${STEPS:-300}" "$@"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
    python3 -c 'import torch; print("torch", torch.__version__)'
    train_with_prelude "$run/train_config.json" 2>&1 | { grep -v -i warn || true; } | tee "$run/train.log"
    summary | tee "$run/summary.txt"
    cp "$run/train/metrics.jsonl" "$OUT/fastpath_${VARIANT:-default}_metrics.jsonl"
    cp "$run/train.log" "$run/summary.txt" "$run/train_config.json" "$OUT/" 2>/dev/null || true ;;
  synccheck)
    dataset=$2
    shift 2
    configure "$dataset" 20 "$@"
    python3 - "$run/train_config.json" <<'PY'
import collections, sys, traceback, warnings

import torch

from dzmodel.cli import main
from dzmodel.train.step import TrainStep

sites, calls = collections.Counter(), [0]
step_call = TrainStep.__call__


def call(self, *args, **kwargs):  # compile and first-use allocations happen in the first steps: watch from the 4th
    calls[0] += 1
    if calls[0] == 4 and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    return step_call(self, *args, **kwargs)


def show(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        stack = [f"{f.filename.split('dzmodel/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "/dzmodel/" in f.filename]
        sites[" <- ".join(stack[::-1][:3]) or f"{filename}:{lineno}"] += 1


TrainStep.__call__ = call
warnings.showwarning = show
warnings.simplefilter("always")
rc = main(["train", "--config", sys.argv[1]])
if torch.cuda.is_available():
    torch.cuda.set_sync_debug_mode("default")
print(f"host syncs from step 4 to the end ({calls[0] - 3} steps):" if sites else "no host sync from step 4 on")
for site, n in sites.most_common():
    print(f"{n:6d}  {site}")
sys.exit(rc)
PY
    ;;
  phases)
    dataset=$2
    shift 2
    configure "$dataset" 33 "$@"
    python3 - "$run/train_config.json" <<'PY'
import collections, statistics, sys, time

import torch
from torch.profiler import ProfilerActivity, profile

from dzmodel.cli import main
from dzmodel.data.device_dataset import DeviceData
from dzmodel.train.step import TrainStep

times, calls, state = collections.defaultdict(list), [0], {"profile": None}
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        if state["profile"] is not None or calls[0] < 4:
            return fn(*args, **kwargs)
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        times[name].append(1000 * (time.perf_counter() - t0))
        return out
    return wrapper


DeviceData.batch = timed("gather + augment", DeviceData.batch)
TrainStep.encode = timed("frozen encoders", TrainStep.encode)
TrainStep.forward_backward = timed("encoders + forward + backward", TrainStep.forward_backward)
step_call = timed("whole step (after gather)", TrainStep.__call__)


def call(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 30:
        state["profile"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        state["profile"].__enter__()
    out = step_call(self, *args, **kwargs)
    if calls[0] == 32:
        sync()
        state["profile"].__exit__(None, None, None)
    return out


TrainStep.__call__ = call
rc = main(["train", "--config", sys.argv[1]])
print("phase                              median ms (steps 4-29, synced)")
for name, values in times.items():
    print(f"{name:34s} {statistics.median(values):8.2f}")
p = state["profile"]
if p is not None:
    events = p.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type)]
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    print(f"kernel launches per step: {launches / 3:.0f}")
    print(p.key_averages().table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                                 row_limit=25, max_name_column_width=70))
    # every kernel, and the device time per step by kind of kernel
    rows = sorted(((e.key, e.self_device_time_total, e.count) for e in kernels if e.self_device_time_total > 0),
                  key=lambda r: -r[1])
    kinds = collections.Counter()
    for name, us, _ in rows:
        low = name.lower()
        kind = ("attention" if ("sdpa" in low or "cudnn" in low or "flash" in low or "attention" in low) else
                "matmul" if ("nvjet" in low or "gemm" in low or "cutlass" in low or "sm90_xmma" in low) else
                "triton" if low.startswith("triton_") else "other")
        kinds[kind] += us / 3000
    print("device ms per step by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.most_common()))
    import csv, os
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "phases_kernels.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["kernel", "ms_per_step", "calls_per_step"])
        for name, us, count in rows:
            w.writerow([name, round(us / 3000, 4), count / 3])
sys.exit(rc)
PY
    ;;
  all)
    bash "$0" synth
    bash "$0" measure "$synth" ;;
  *) echo "usage: $0 synth [EPISODES] [LENGTH] | measure DATASET [K=V ..] | synccheck DATASET [K=V ..] | phases DATASET [K=V ..] | all" >&2
     exit 2 ;;
esac
