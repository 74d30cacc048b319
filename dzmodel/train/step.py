"""One supervised fine-tuning step's loss: collated batch -> frozen encoders -> noised inputs -> WAM -> losses."""

from __future__ import annotations

import torch

from ..model.conditioning import EncodedBatch, encode_batch
from ..model.objective import FlowMatchSchedule, Losses, flow_matching_losses, sample_timestep_ids
from ..model.wam import DreamZeroWAM


def _per_sample_draws(positions: torch.Tensor, seed: int, F: int, a, latent_shape, action_shape):
    """Timestep ids and noise drawn per sample from (seed, stream position): the same sample gets the same
    draws whatever the micro-batch size, accumulation or world size (so those runs are comparable)."""
    ids, aids, noise, noise_a = [], [], [], []
    for pos in positions.tolist():
        g = torch.Generator().manual_seed(seed * 1_000_003 + int(pos))
        _, i, ai = sample_timestep_ids(1, F, a.num_frame_per_block, a.num_action_per_block, generator=g)
        ids.append(i)
        aids.append(ai)
        noise.append(torch.randn((1, *latent_shape[1:]), generator=g))
        noise_a.append(torch.randn((1, *action_shape[1:]), generator=g))
    return torch.cat(ids), torch.cat(aids), torch.cat(noise), torch.cat(noise_a)


def sft_losses(model: DreamZeroWAM, encoders, batch: dict[str, torch.Tensor], schedule: FlowMatchSchedule,
               generator: torch.Generator | None = None, attn_backend: str = "auto",
               noise_seed: int | None = None) -> Losses:
    """`batch` follows dzmodel.data.collate; `encoders` has .vae, .text_encoder, .image_encoder.
    With `noise_seed` and batch["position"], draws are per sample; else from `generator`."""
    dev = model.patch_embedding.weight.device
    batch = {k: v.to(dev) for k, v in batch.items()}
    enc = encode_batch(model.args, encoders.vae, encoders.text_encoder, encoders.image_encoder, batch["images"],
                       batch["text"], batch["text_attention_mask"])
    return losses_from_encoded(model, enc, batch, schedule, generator, attn_backend, noise_seed)


def losses_from_encoded(model: DreamZeroWAM, enc: EncodedBatch, batch: dict[str, torch.Tensor],
                        schedule: FlowMatchSchedule, generator: torch.Generator | None = None,
                        attn_backend: str = "auto", noise_seed: int | None = None) -> Losses:
    """The loss from frozen-encoder outputs (computed online, or read from `dz cache`)."""
    a = model.args
    dev = model.patch_embedding.weight.device
    latents = enc.clean_latents.float()
    B, F = latents.shape[0], latents.shape[2]
    actions, state = batch["action"].to(dev), batch["state"].to(dev)
    blocks = (F - 1) // a.num_frame_per_block
    if actions.shape[1] != blocks * a.num_action_per_block:
        raise ValueError(f"the batch has {actions.shape[1]} action rows, the model wants {blocks} chunks x "
                         f"{a.num_action_per_block} (embodiment action_horizon must equal num_action_per_block)")
    if noise_seed is not None and "position" in batch:
        ids, aids, noise, noise_a = _per_sample_draws(batch["position"].cpu(), noise_seed, F, a, latents.shape,
                                                      actions.shape)
    else:
        _, ids, aids = sample_timestep_ids(B, F, a.num_frame_per_block, a.num_action_per_block, generator=generator)
        noise = torch.randn(latents.shape, generator=generator)
        noise_a = torch.randn(actions.shape, generator=generator)
    ids, aids, noise, noise_a = ids.to(dev), aids.to(dev), noise.to(dev), noise_a.to(dev)
    out = model(schedule.add_noise(latents, noise, ids, 2), latents, schedule.timestep(ids),
                schedule.add_noise(actions, noise_a, aids, 1), schedule.timestep(aids), state,
                enc.context, enc.clip_feature, y=enc.y, attn_backend=attn_backend)
    return flow_matching_losses(schedule, out.video_pred, out.action_pred, latents, noise, actions, noise_a,
                                ids, aids, batch["action_mask"].to(dev), batch["has_real_action"].to(dev))
