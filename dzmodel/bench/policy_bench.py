"""`dz bench policy`: inference latency of one action chunk (`DreamZeroPolicy.predict_actions`) per preset.

Random weights at the preset's real sizes (the DiT and its frozen encoders), a fresh single-frame observation
per call as in the LIBERO protocol (reference §6.1: the KV cache restarts on every call), so each call
runs the text and image encoders, one VAE encode, the prefill and the flow solver (with CFG: two caches).
CUDA: bf16 autocast over fp32 weights, CUDA-event timing. Reports p50 / p95 / max milliseconds per chunk.
"""

from __future__ import annotations

import statistics
import tempfile
import time

import numpy as np
import torch

from ..model.args import preset
from ..model.components import build_encoders, build_policy
from ..model.inference import NormStats, SolverConfig
from ..model.tokenizer import build_tiny_tokenizer, load_tokenizer
from ..model.wam import DreamZeroWAM


def run_policy_bench(preset_name: str = "tiny", device: str = "cpu", solver_steps: int = 16, cfg_scale: float = 5.0,
                     calls: int = 10, warmup: int = 2, seed: int = 0, batch_cfg: bool = True) -> dict:
    torch.manual_seed(seed)
    args = preset(preset_name)
    with torch.device(device):
        model = DreamZeroWAM(args)
        encoders = build_encoders(preset_name, device=device)
    with tempfile.TemporaryDirectory() as tok_dir:  # ids only feed the embedding; latency does not depend on them
        tokenizer = load_tokenizer(build_tiny_tokenizer(tok_dir))
    stats = NormStats(q01=-np.ones(args.action_dim), q99=np.ones(args.action_dim))
    state_stats = NormStats(q01=-np.ones(8), q99=np.ones(8))
    policy = build_policy(model, encoders, tokenizer, stats, state_stats,
                          solver=SolverConfig(num_steps=solver_steps, cfg_scale=cfg_scale, batch_cfg=batch_cfg),
                          seed=seed)
    h, w = encoders.spec.image_size
    rng = np.random.default_rng(seed)
    cuda = device.startswith("cuda")
    times = []
    for i in range(warmup + calls):
        obs = {"images": rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "state": np.zeros(8),
               "prompt": "pick up the bowl and place it on the plate", "session_id": "bench"}
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            actions = policy.predict_actions(obs)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"preset": preset_name, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "solver_steps": solver_steps, "cfg_scale": cfg_scale, "batch_cfg": batch_cfg, "image_size": [h, w],
            "calls": calls, "torch": torch.__version__,
            "chunk_shape": list(actions.shape), "p50_ms": round(statistics.median(times), 1),
            "p95_ms": round(times[min(len(times) - 1, int(0.95 * len(times)))], 1), "max_ms": round(times[-1], 1),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
