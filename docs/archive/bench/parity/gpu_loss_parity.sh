#!/usr/bin/env bash
# Run from the repo root on a GPU machine, after building a tiny-preset encoder cache into gpucheck/cache
# (dz data synth + dz data metadata + dz cache with the tabletop_pusher embodiment of tests/train/test_trainer.py).
# GPU loss parity on the tiny preset from the encoder cache: plain vs optimised path, bf16, 50 steps.
set -e
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
COMMON="--set cache=gpucheck/cache --set steps=50 --set save_every=50 --set global_batch=8 --set lr=0.0003 --set precision=bf16 --set progress=false --preset tiny"
python3 -m dzmodel.cli train $COMMON --set micro_batch=1 --set compile=false --set attn_backend=sdpa --set activation_checkpointing=none --out $OUT/plain 2>&1 | grep -v -i warn | tail -1
python3 -m dzmodel.cli train $COMMON --set micro_batch=8 --set compile=true --set attn_backend=flex --set activation_checkpointing=full --out $OUT/opt 2>&1 | grep -v -i warn | tail -1
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
a = [json.loads(l)["loss"] for l in open(f"{o}/plain/metrics.jsonl")]
b = [json.loads(l)["loss"] for l in open(f"{o}/opt/metrics.jsonl")]
rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
print(f"steps {len(a)}/{len(b)}  max rel diff {max(rel):.2e}  mean rel diff {sum(rel)/len(rel):.2e}")
print("plain first/last", round(a[0], 4), round(a[-1], 4), " optimised first/last", round(b[0], 4), round(b[-1], 4))
PY
cp $OUT/plain/metrics.jsonl $OUT/plain_metrics.jsonl; cp $OUT/opt/metrics.jsonl $OUT/opt_metrics.jsonl
rm -rf $OUT/plain $OUT/opt
