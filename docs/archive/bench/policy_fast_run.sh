#!/usr/bin/env bash
# Issue 14: one action chunk on one GPU, every optimisation in turn (`--ladder`) and the batch scaling at the
# deploy setting (5B), or the 14B settings (PRESET=dreamzero_14b). Run from the repo root on the device machine;
# JSON lines go to $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PRESET=${PRESET:-dreamzero_5b}
export GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
echo "$GPU $(python -c 'import torch; print(torch.__version__)')"
B="python -m dzmodel.cli bench policy --preset $PRESET --device cuda"
show() { python -c 'import json,sys
for l in sys.stdin:
    r = json.loads(l); print(r["name"][:52].ljust(52), r["batch"], r.get("p50_ms"), r.get("p95_ms"), r.get("chunks_per_s"), r.get("breakdown_ms"), r.get("error", ""))'; }
if [ "$PRESET" = dreamzero_5b ]; then
  $B --ladder --calls 6 --warmup 2 --breakdown-calls 2 --out $OUT/policy_5b_ladder_$GPU.jsonl | show
  $B --name "deploy: 16 steps (8 DiT), CFG 5, bf16, graphs, compile" --dit-steps upstream --compile --batch 1,8,32 \
     --calls 4 --warmup 2 --breakdown-calls 1 --out $OUT/policy_5b_batch_$GPU.jsonl | show
else  # 14B: bf16 weights from the start (fp32 14B + umT5-XXL exceed one H100)
  python - <<'PY' | show
import json, os
from dzmodel.bench.policy_bench import PolicySetting as S, run_policy_bench
path = f"{os.environ['OUT']}/policy_14b_{os.environ['GPU']}.jsonl"
def emit(row):
    print(json.dumps(row), flush=True)
    open(path, "a").write(json.dumps(row) + "\n")
run_policy_bench("dreamzero_14b", "cuda", [
    S("14B: 4 steps, no CFG, compile", solver_steps=4, cfg_scale=1.0, compile=True),
    S("14B: 16 steps (8 DiT), no CFG, compile", dit_steps="upstream", cfg_scale=1.0, compile=True),
    S("14B: 4 steps, CFG 5, compile", solver_steps=4, compile=True),
    S("14B: 16 steps (8 DiT), CFG 5, compile", dit_steps="upstream", compile=True),
    S("14B: 16 steps, CFG 5 (quality reference), compile", compile=True)], calls=4, breakdown_calls=1, progress=emit)
PY
fi
