"""Synthetic training micro-batches of one shape, in the trainer's batch layout (encoded, as the cache stores them, or
raw images and text for the encoders): for benchmarks and tests where neither data nor weights are at hand."""

from __future__ import annotations

import torch

from ..model.synthetic import random_inputs


def synthetic_batches(args, micro_batch: int, latent_hw, device, encoders: str):
    """Endless micro-batches of one shape, made once on the device: encoded (the cache's keys) or raw images,
    text and masks for the encoders. Each carries new stream positions, so every micro-batch draws new noise."""
    g = torch.Generator(device=device).manual_seed(0)
    B, K, A = micro_batch, args.max_chunk_size, args.num_action_per_block
    base = {"state": torch.rand(B, K * args.num_state_per_block, args.max_state_dim, generator=g, device=device),
            "action": torch.rand(B, K * A, args.action_dim, generator=g, device=device) * 2 - 1,
            "has_real_action": torch.ones(B, dtype=torch.bool, device=device)}
    base["action_mask"] = torch.ones_like(base["action"], dtype=torch.bool)
    if encoders == "cache":
        x = random_inputs(args, B, latent_hw, device, torch.float32, g)
        base.update(clean_latents=x["clean_latents"], context=x["context"], clip_feature=x["clip_feature"],
                    **({"y": x["y"]} if x["y"] is not None else {}))
    else:
        vae_factor = 16 if args.in_dim == 48 else 8
        frames = 4 * (args.num_frames - 1) + 1
        size = (latent_hw[0] * vae_factor, latent_hw[1] * vae_factor)
        base.update(images=torch.randint(0, 255, (B, frames, *size, 3), generator=g, device=device,
                                         dtype=torch.uint8),
                    text=torch.randint(3, 640, (B, args.text_len), generator=g, device=device),  # < every vocab
                    text_attention_mask=torch.ones(B, args.text_len, dtype=torch.long, device=device))
    for k in range(1 << 62):
        yield {**base, "position": torch.arange(k * B, (k + 1) * B)}
