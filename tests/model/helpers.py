"""Small builders shared by the model tests."""

import torch

from dzmodel.model.args import DreamZeroArgs, preset
from dzmodel.model.objective import action_timestep_ids, tie_timestep_ids
from dzmodel.model.sampler import (Conditioning, KVCache, SolverConfig, draw_noise, interleave_cfg, solve,
                                   solve_two_passes)
from dzmodel.model.wam import DreamZeroWAM


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter O(1) random values (like the fixtures) so every path matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "modulation" not in name:
                fan_in = p.shape[1] if not name.endswith(".W") else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            elif "modulation" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def tiny_model(seed: int = 0, **overrides) -> DreamZeroWAM:
    torch.manual_seed(seed)
    return randomize_(DreamZeroWAM(preset("tiny", **overrides)), seed).eval()


def tiny_batch(args: DreamZeroArgs, batch: int = 2, latent_hw=(4, 6), seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    F = args.num_frames
    K = args.max_chunk_size
    A = args.num_action_per_block
    tid = torch.randint(0, 1000, (batch, F), generator=g)
    from dzmodel.model.objective import FlowMatchSchedule, action_timestep_ids, tie_timestep_ids

    sched = FlowMatchSchedule()
    tied = tie_timestep_ids(tid, args.num_frame_per_block)
    aid = action_timestep_ids(tied, args.num_frame_per_block, A)
    return dict(
        noisy_latents=torch.randn(batch, args.in_dim, F, *latent_hw, generator=g),
        clean_latents=torch.randn(batch, args.in_dim, F, *latent_hw, generator=g),
        timestep=sched.timestep(tied),
        noisy_actions=torch.randn(batch, K * A, args.action_dim, generator=g),
        timestep_action=sched.timestep(aid),
        state=torch.randn(batch, K, args.max_state_dim, generator=g),
        context=torch.randn(batch, args.text_len, args.text_dim, generator=g),
        clip_feature=torch.randn(batch, args.clip_tokens, args.clip_dim, generator=g),
    )


# Test harnesses: the library samples timesteps inside the training step and blocks inside the policy; the tests
# drive the same pieces directly.

def sample_timestep_ids(batch: int, num_frames: int, num_frame_per_block: int, num_action_per_block: int,
                        num_train_timesteps: int = 1000, generator: torch.Generator | None = None,
                        device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(raw ids [B, F], tied ids [B, F], action ids [B, K·A]) as the training step draws them (STANDARD mode)."""
    raw = torch.randint(0, num_train_timesteps, (batch, num_frames), generator=generator, device=device)
    tied = tie_timestep_ids(raw, num_frame_per_block)
    return raw, tied, action_timestep_ids(tied, num_frame_per_block, num_action_per_block)


@torch.no_grad()
def sample_block(model: DreamZeroWAM, caches: tuple[KVCache, KVCache | None], conds: tuple[Conditioning, Conditioning | None],
                 state: torch.Tensor, latent_hw: tuple[int, int], solver: SolverConfig,
                 generator: torch.Generator | None = None, action_dims: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The next block from separate conditional and unconditional caches: noise, then the Euler solver.
    CFG (scale != 1 with an unconditional cache) on video only. action_dims: the robot's own (None: all)."""
    video, actions = draw_noise(model, state.shape[0], latent_hw, state.device, generator, action_dims)
    guided = solver.cfg_scale != 1.0 and caches[1] is not None and conds[1] is not None
    if guided and not solver.batch_cfg:
        return solve_two_passes(model, caches, conds, state, video, actions, solver,  # type: ignore[arg-type]
                                action_dims)
    if guided:
        cache, cond = interleave_cfg(caches, conds)  # type: ignore[arg-type]
        return solve(model, cache, cond, state, video, actions, solver, guided=True, action_dims=action_dims)
    return solve(model, caches[0], conds[0], state, video, actions, solver, guided=False, action_dims=action_dims)
