# Issue 14, second device call: the kernel profile of a 5B chunk, torch.compile inside the graphs, and 14B.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python docs/bench/policy_profile.py 2>&1 | grep -v -i warn
python - <<'PY' 2>&1 | grep -v -i warn
import json, os
from dzmodel.bench.policy_bench import PolicySetting as S, run_policy_bench
out = os.environ["OUT"]
def emit(path):
    def f(row):
        print(json.dumps({k: row.get(k) for k in ("preset", "name", "batch", "p50_ms", "p95_ms", "breakdown_ms", "peak_mem_gib", "error")}))
        open(f"{out}/{path}", "a").write(json.dumps(row) + "\n")
    return f
run_policy_bench("dreamzero_5b", "cuda", [S("fast: 4 steps, CFG 5, + torch.compile", solver_steps=4, compile=True),
                                           S("16 steps upstream DiT caching, CFG 5, + torch.compile", dit_steps="upstream", compile=True)],
                 calls=8, progress=emit("policy_5b_compile_h100.jsonl"))
run_policy_bench("dreamzero_14b", "cuda", [S("14B: 4 steps, no CFG", solver_steps=4, cfg_scale=1.0),
                                            S("14B: 4 steps, CFG 5", solver_steps=4),
                                            S("14B: 16 steps upstream DiT caching, no CFG", dit_steps="upstream", cfg_scale=1.0),
                                            S("14B: 16 steps upstream DiT caching, CFG 5", dit_steps="upstream"),
                                            S("14B: 16 steps, CFG 5 (reference)")],
                 calls=5, progress=emit("policy_14b_h100.jsonl"))
PY
