"""Where the GPU time of one 5B action chunk goes (issue 14): kernel time per kind, eager bf16, no CFG, 4 steps.
Run on the device machine: python docs/bench/policy_profile.py [preset]. Prints the top kernels by CUDA time."""

import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from dzmodel.bench.policy_bench import PolicySetting, _build, _configure

preset = sys.argv[1] if len(sys.argv) > 1 else "dreamzero_5b"
policy = _build(preset, "cuda", "bf16", 0)
_configure(policy, PolicySetting(solver_steps=4, cfg_scale=1.0, cuda_graphs=False), "cuda")
h, w = policy.image_size
obs = {"images": np.zeros((h, w, 3), np.uint8), "state": np.zeros(8), "prompt": "pick up the bowl", "session_id": "p"}
for _ in range(2):
    policy.predict_actions(dict(obs))
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    policy.predict_actions(dict(obs))
    torch.cuda.synchronize()
events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
total = sum(e.self_device_time_total for e in events)
print(f"kernels {sum(e.count for e in events)}  GPU time {total / 1e3:.1f} ms")
for e in sorted(events, key=lambda e: -e.self_device_time_total)[:18]:
    print(f"{e.self_device_time_total / 1e3:8.2f} ms {e.count:6d}x  {e.key[:110]}")
