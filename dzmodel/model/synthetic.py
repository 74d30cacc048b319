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


def training_sample(a, latent_hw: tuple[int, int], generator: torch.Generator, device="cpu",
                    dtype=torch.float32, blocks: int | None = None) -> dict:
    """One sample (a batch of one) of args `a` with `blocks` chunks (default max_chunk_size) on a latent grid, its
    timesteps tied as training ties them (a block's frames and actions share the block's): what packing feeds."""
    from .objective import FlowMatchSchedule, action_timestep_ids, tie_timestep_ids

    K = a.max_chunk_size if blocks is None else blocks
    F_, A = 1 + K * a.num_frame_per_block, a.num_action_per_block
    tied = tie_timestep_ids(torch.randint(0, 1000, (1, F_), generator=generator), a.num_frame_per_block)
    sched = FlowMatchSchedule()
    s = dict(noisy_latents=torch.randn(1, a.in_dim, F_, *latent_hw, generator=generator),
             clean_latents=torch.randn(1, a.in_dim, F_, *latent_hw, generator=generator),
             timestep=sched.timestep(tied),
             noisy_actions=torch.randn(1, K * A, a.action_dim, generator=generator),
             timestep_action=sched.timestep(action_timestep_ids(tied, a.num_frame_per_block, A)),
             state=torch.randn(1, K * a.num_state_per_block, a.max_state_dim, generator=generator),
             context=torch.randn(1, a.text_len, a.text_dim, generator=generator),
             clip_feature=torch.randn(1, a.clip_tokens, a.clip_dim, generator=generator))
    return {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in s.items()}
