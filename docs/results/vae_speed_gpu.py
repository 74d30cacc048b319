"""Speed of the small preset's VAE where the libero_object profile spends it, on clips already on the GPU (no data
path), with cuDNN's algorithm timing (`torch.backends.cudnn.benchmark`) off and then on:
  - the vision stage's training loop (`dzmodel.train.vision._train_steps`, what `dz stage vision` runs): 16 clips of
    9 frames at 128x256 a step, bf16 autocast, AdamW;
  - encoding training windows as `train.encoded_variants` does (17 frames at 128x256, 128 windows a call, bf16).
One JSON line per setting. Usage (a GPU machine, from the repository root):

    PYTHONPATH=$PWD python3 docs/results/vae_speed_gpu.py [STEPS] [ENCODE_CALLS]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from dzmodel.model.components import build_encoders
from dzmodel.model.conditioning import video_to_unit_range
from dzmodel.train.vision import _train_steps


class _NoBar:
    def update(self, *args, **kwargs) -> None:
        pass


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    encode_calls = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    clips = torch.randint(0, 256, (16, 9, 128, 256, 3), dtype=torch.uint8, device=dev, generator=gen)
    windows = torch.randint(0, 256, (128, 17, 128, 256, 3), dtype=torch.uint8, device=dev, generator=gen)
    for autotune in (False, True):
        torch.backends.cudnn.benchmark = autotune
        torch.manual_seed(0)
        vae = build_encoders("small", "cpu").vae.float().to(dev).requires_grad_(True)
        optimizer = torch.optim.AdamW(vae.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-4)

        def train(n):
            return lambda: _train_steps(vae, [clips] * n, optimizer, steps, 1e-3, 1e-5, dev, _NoBar(), seed=0)

        first = _timed(train(1))
        warm = _timed(train(9))
        steady = _timed(train(steps))
        vae.eval()

        def encode(n):
            def run():
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for _ in range(n):
                        vae.encode(video_to_unit_range(windows))
            return run

        encode_first = _timed(encode(1))
        encode_steady = _timed(encode(encode_calls))
        print(json.dumps({"cudnn_benchmark": autotune, "device": torch.cuda.get_device_name(),
                          "vision_first_step_s": round(first, 2), "vision_next_9_steps_s": round(warm, 2),
                          "vision_steps_per_s": round(steps / steady, 2), "encode_first_call_s": round(encode_first, 2),
                          "encode_windows_per_s": round(128 * encode_calls / encode_steady, 1)}), flush=True)


if __name__ == "__main__":
    main()
