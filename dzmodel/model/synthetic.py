"""Random forward inputs of a model's args: what benchmarks, synthetic caches and tests feed a model when the
numbers do not matter, only the shapes."""

from __future__ import annotations

import torch


def random_inputs(a, batch: int, latent_hw: tuple[int, int], device, dtype, generator):
    """The model's forward inputs for `batch` samples of args `a` on a latent grid, drawn from `generator`."""
    F_ = a.num_frames
    K = a.max_chunk_size
    z = a.in_dim - (20 if a.concat_first_frame_latent else 0)

    def rn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    return dict(
        noisy_latents=rn(batch, z, F_, *latent_hw), clean_latents=rn(batch, z, F_, *latent_hw),
        timestep=torch.rand(batch, F_, generator=generator, device=device) * 1000,
        noisy_actions=rn(batch, K * a.num_action_per_block, a.action_dim),
        timestep_action=torch.rand(batch, K * a.num_action_per_block, generator=generator, device=device) * 1000,
        state=rn(batch, K * a.num_state_per_block, a.max_state_dim),
        context=rn(batch, a.text_len, a.text_dim), clip_feature=rn(batch, a.clip_tokens, a.clip_dim),
        y=rn(batch, 20, F_, *latent_hw) if a.concat_first_frame_latent else None,
    )
