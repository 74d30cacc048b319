"""DreamZero's flow-matching objective (reference §1.7).

- Grid: sigma_i = 1 - i/1000 (i = 0..999), shifted sigma' = 5 sigma / (1 + 4 sigma), t_i = 1000 sigma'.
- Ids ~ U{0..999} per latent frame; every frame of a block takes the block's first id; frame 0
  keeps its own. Actions (and states) of block k take block k's id.
- x_t = (1 - sigma) x0 + sigma eps for latents and normalised actions; target = eps - x0.
- w(t) = exp(-2((t - 500)/1000)^2), minus its grid minimum, rescaled to mean 1 over the grid.
- dynamics = mean_{B,F}[ mean_{C,H,W}(v - target)^2 · w ]
  action   = mean_{B,step}[ mean_{dims}((a - target)^2 · mask) · has_real_action · w ]
  loss = dynamics + action, computed in fp32.

The grid is built in float32 exactly as upstream's scheduler does, so ids map to the same t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class FlowMatchSchedule:
    def __init__(self, num_train_timesteps: int = 1000, shift: float = 5.0):
        n = num_train_timesteps
        sigmas = torch.linspace(1.0, 0.0, n + 1)[:-1]
        self.num_train_timesteps = n
        self.shift = shift
        self.sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = self.sigmas * n
        y = torch.exp(-2 * ((self.timesteps - n / 2) / n) ** 2)
        y = y - y.min()
        self.weights = y * (n / y.sum())
        self._on_device: dict[tuple[int, torch.device], torch.Tensor] = {}

    def _table(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """table[ids], with the table copied to the ids' device once (a copy per call would wait for the GPU)."""
        if ids.device.type == "cpu":
            return table[ids]
        key = (id(table), ids.device)
        if key not in self._on_device:
            self._on_device[key] = table.to(ids.device)
        return self._on_device[key][ids]

    def sigma(self, ids: torch.Tensor) -> torch.Tensor:
        return self._table(self.sigmas, ids)

    def timestep(self, ids: torch.Tensor) -> torch.Tensor:
        return self._table(self.timesteps, ids)

    def weight(self, ids: torch.Tensor) -> torch.Tensor:
        return self._table(self.weights, ids)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """x_t for ids indexing along `dim` of x0 (frames for latents [B,C,F,H,W], steps for actions)."""
        sigma = self.sigma(ids).to(x0.dtype)
        shape = [1] * x0.dim()
        shape[0], shape[dim] = sigma.shape
        sigma = sigma.reshape(shape)
        return (1 - sigma) * x0 + sigma * noise

    def inference_sigmas(self, num_steps: int) -> torch.Tensor:
        """Shifted sigmas from 1 to 0 over `num_steps` solver steps (num_steps + 1 points)."""
        s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
        return (self.shift * s / (1 + (self.shift - 1) * s)).float()


def tie_timestep_ids(raw: torch.Tensor, num_frame_per_block: int) -> torch.Tensor:
    """Every frame of a block takes the block's first id; frame 0 keeps its own."""
    B, F_ = raw.shape
    blocks = raw[:, 1:].reshape(B, -1, num_frame_per_block)
    blocks = blocks[:, :, :1].expand_as(blocks)
    return torch.cat([raw[:, :1], blocks.reshape(B, -1)], dim=1)


def action_timestep_ids(tied: torch.Tensor, num_frame_per_block: int, num_action_per_block: int) -> torch.Tensor:
    """Actions of block k take block k's id: [B, K·A]."""
    per_block = tied[:, 1::num_frame_per_block]  # first frame of each block
    return per_block.repeat_interleave(num_action_per_block, dim=1)


@dataclass
class Losses:
    loss: torch.Tensor
    dynamics_loss: torch.Tensor
    action_loss: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"loss": self.loss, "dynamics_loss": self.dynamics_loss, "action_loss": self.action_loss}


def flow_matching_losses(schedule: FlowMatchSchedule, video_pred: torch.Tensor, action_pred: torch.Tensor,
                         latents: torch.Tensor, noise: torch.Tensor, actions: torch.Tensor,
                         noise_action: torch.Tensor, ids: torch.Tensor, action_ids: torch.Tensor,
                         action_mask: torch.Tensor, has_real_action: torch.Tensor) -> Losses:
    """latents/noise/video_pred [B, C, F, H, W]; actions/noise_action/action_pred/action_mask [B, K·A, D];
    ids [B, F]; action_ids [B, K·A]; has_real_action [B] (applied per sample)."""
    target = (noise - latents).float()
    # An odd latent height/width loses its last row/column in the patch conv: crop the target to match.
    target = target[..., : video_pred.shape[-2], : video_pred.shape[-1]]
    per_frame = F.mse_loss(video_pred.float(), target, reduction="none").mean(dim=(1, 3, 4))  # [B, F]
    dynamics = (per_frame * schedule.weight(ids)).mean()

    target_action = (noise_action - actions).float()
    sq = F.mse_loss(action_pred.float(), target_action, reduction="none") * action_mask.float()
    sq = sq * has_real_action.float().reshape(-1, 1, 1)
    action = (sq.mean(dim=2) * schedule.weight(action_ids)).mean()
    return Losses(loss=dynamics + action, dynamics_loss=dynamics, action_loss=action)
