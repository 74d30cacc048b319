"""Speed of the small preset's VAE where the libero_object profile spends it, on clips already on the GPU (no data
path), eager and as CUDA graphs:
  - the vision stage's training loop (`dzmodel.train.vision._train_steps`, what `dz stage vision` runs): 16 clips of
    9 frames at 128x256 a step, bf16 autocast, AdamW; both runs start from the same VAE and see the same clips and
    noise, so their losses should agree;
  - encoding training windows (17 frames at 128x256, 128 windows a call, bf16), eager and through `GraphCache` (as
    `train.cuda_graphs` encodes the augmented copies).
With `--cudnn-benchmark`, cuDNN times its algorithms first (`torch.backends.cudnn.benchmark`). One JSON line per
setting. Usage (a GPU machine, from the repository root):

    PYTHONPATH=$PWD python3 docs/archive/results/vae_speed_gpu.py [--steps 150] [--encode-calls 10] [--cudnn-benchmark]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dzmodel.model.components import build_encoders
from dzmodel.model.conditioning import video_to_unit_range
from dzmodel.model.cuda_graphs import GraphCache
from dzmodel.train.vision import _train_steps


class _NoBar:
    def update(self, *args, **kwargs) -> None:
        pass


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--encode-calls", type=int, default=10)
    parser.add_argument("--cudnn-benchmark", action="store_true")
    opts = parser.parse_args()
    torch.backends.cudnn.benchmark = opts.cudnn_benchmark
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    clips = torch.randint(0, 256, (16, 9, 128, 256, 3), dtype=torch.uint8, device=dev, generator=gen)
    windows = torch.randint(0, 256, (128, 17, 128, 256, 3), dtype=torch.uint8, device=dev, generator=gen)
    common = {"device": torch.cuda.get_device_name(), "cudnn_benchmark": opts.cudnn_benchmark}
    for graphs in (False, True):
        torch.manual_seed(0)
        vae = build_encoders("small", "cpu").vae.float().to(dev).requires_grad_(True)
        optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-4)

        def train(n, seed):
            return lambda: _train_steps(vae, [clips] * n, optimizer, opts.steps, 1e-3, 1e-5, dev, _NoBar(),
                                        seed=seed, cuda_graphs=graphs)

        first, _ = _timed(train(10, 0))  # the first steps: capture (graphs) or lazy initialisation
        steady, history = _timed(train(opts.steps, 1))
        print(json.dumps({**common, "what": "vision training loop", "cuda_graphs": graphs,
                          "first_10_steps_s": round(first, 2), "steps_per_s": round(opts.steps / steady, 2),
                          "last_loss": history[-1]["loss"]}), flush=True)

        vae.eval().requires_grad_(False)  # frozen, as the trainer's encoders (autocast caches no casts of them)
        cache = GraphCache(enabled=graphs)

        def encode(n):
            def run():
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for _ in range(n):
                        out = cache.run("encode", lambda: lambda w: [vae.encode(video_to_unit_range(w))], [windows]) \
                            if graphs else [vae.encode(video_to_unit_range(windows))]
                return out[0]
            return run

        first, _ = _timed(encode(1))
        steady, latents = _timed(encode(opts.encode_calls))
        print(json.dumps({**common, "what": "encode 128 windows of 17 frames", "cuda_graphs": graphs,
                          "first_call_s": round(first, 2),
                          "windows_per_s": round(128 * opts.encode_calls / steady, 1),
                          "latent_checksum": float(latents.float().abs().sum())}), flush=True)


if __name__ == "__main__":
    main()
