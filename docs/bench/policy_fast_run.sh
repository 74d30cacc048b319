#!/usr/bin/env bash
# Issue 14: one action chunk on one GPU, every optimisation in turn (`--ladder`), the batch scaling and the old code.
# Run from the repo root on the device machine; JSON lines go to $OUT. Optional: old/dzmodel = the code before the
# fast path (`git archive 43f0807 dzmodel | tar -x -C old`), measured in the same lease for the "before" row.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PRESET=${PRESET:-dreamzero_5b}
TAG=${TAG:-5b}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
echo "$GPU $(python -c 'import torch; print(torch.__version__)')"
# the CUDA-graph path equals the eager path on the GPU (tiny policy), and captures once per shape
python - <<'PY'
import tempfile, numpy as np, torch
from dzmodel.model.components import build_tiny_policy
from dzmodel.model.inference import SolverConfig
rng = np.random.default_rng(0)
obs = [{"images": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "state": rng.uniform(-1, 1, 8), "prompt": "x",
        "session_id": f"s{i}"} for i in range(3)]
out = []
for graphs in (False, True):
    p = build_tiny_policy(tempfile.mkdtemp(), solver=SolverConfig(num_steps=16, cfg_scale=5.0, dit_steps="upstream"))
    p.model.cuda(); [m.cuda() for m in (p.vae, p.text_encoder, p.image_encoder)]
    from dzmodel.model.cuda_graphs import GraphCache
    p.graphs = GraphCache(enabled=graphs)
    out.append([p.predict_batch([dict(o) for o in obs]) for _ in range(3)][-1])
    print("graphs" if graphs else "eager", "captures", p.graphs.captures, "replays", p.graphs.replays)
print("max |graph - eager|", max(float(np.abs(a - b).max()) for a, b in zip(*out)))
PY
B="python -m dzmodel.cli bench policy --preset $PRESET --device cuda"
if [ "$PRESET" = dreamzero_5b ]; then
  $B --ladder --calls 8 --warmup 2 --out $OUT/policy_${TAG}_ladder_$GPU.jsonl | cut -c1-420
  $B --name "deploy: bf16, graphs, 16 steps, upstream DiT caching, CFG 5" --dit-steps upstream --batch 1,8,32 \
     --calls 6 --warmup 2 --out $OUT/policy_${TAG}_batch_$GPU.jsonl | cut -c1-420
  $B --name "deploy, no CFG" --dit-steps upstream --cfg-scale 1 --batch 1,8,32 --calls 6 --warmup 2 \
     --out $OUT/policy_${TAG}_batch_$GPU.jsonl | cut -c1-420
  if [ -d old/dzmodel ]; then  # the code before this issue's work, same lease
    for a in "--no-batch-cfg" ""; do
      PYTHONPATH=$PWD/old python -m dzmodel.cli bench policy --preset $PRESET --device cuda --solver-steps 16 --cfg-scale 5 \
        --calls 8 --warmup 2 $a --out $OUT/policy_${TAG}_old_code_$GPU.jsonl
    done
  fi
else  # 14B: bf16 weights from the start (fp32 14B + umT5-XXL exceed one H100)
  for args in "--name ref16_cfg5" "--name upstream_cfg5 --dit-steps upstream" "--name upstream_nocfg --dit-steps upstream --cfg-scale 1" \
              "--name 4steps_nocfg --solver-steps 4 --cfg-scale 1" "--name 4steps_cfg5 --solver-steps 4"; do
    $B $args --calls 5 --warmup 2 --out $OUT/policy_${TAG}_$GPU.jsonl | cut -c1-420
  done
fi
