"""The frozen-encoder half of a training step: a micro-batch of clips and prompts -> model inputs.

Batched over the whole micro-batch (one VAE call, one CLIP call, one T5 call), unlike upstream's
per-sample loops. The first-frame condition `y` (a second VAE encode of [frame 0, zeros...]) is
computed only for models that consume it (14B, `concat_first_frame_latent`); upstream's 5B path
computes it and throws it away. Text embeddings are zeroed beyond each sample's own length
(upstream truncated the whole micro-batch to its shortest prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .args import DreamZeroArgs
from .t5 import zero_beyond_lengths


# The unconditional prompt: what inference's CFG branch encodes by default (`DreamZeroPolicy.negative_prompt`) and
# what training's prompt dropout (`train.prompt_dropout`) substitutes, so that branch sees a context it trained on.
NULL_PROMPT = ""


@torch.no_grad()
def encode_prompts(tokenizer, text_encoder, prompts: list[str], text_len: int, device) -> torch.Tensor:
    """umT5 embeddings [B, text_len, text_dim] of `prompts`, zero past each prompt's own length: the tokens,
    mask and zeroing of `encode_batch` (training) and `DreamZeroPolicy._text` (inference)."""
    ids, mask = tokenizer(list(prompts), max_length=text_len)
    ids, mask = ids.to(device), mask.to(device)
    return zero_beyond_lengths(text_encoder(ids, mask), mask)


def prompt_rows(*contexts: torch.Tensor) -> int:
    """The rows that hold the prompts of `contexts` (each [P, text_len, text_dim]): every row from this one on is
    zero in each of them, as `encode_prompts` leaves a prompt's padding. text_len where some prompt fills it
    (or the rows past a prompt are not zero: nothing can be left out)."""
    last = 0
    for context in contexts:
        for chunk in context.detach().split(64):  # a few prompts at a time: no copy of a large table
            used = (chunk.amax(dim=-1) != 0) | (chunk.amin(dim=-1) != 0)  # [p, text_len]
            positions = torch.arange(1, used.shape[-1] + 1, device=used.device)
            last = max(last, int((used * positions).amax()))
    return last


@dataclass
class EncodedBatch:
    clean_latents: torch.Tensor        # [B, z, F, h, w], normalised
    context: torch.Tensor              # [B, text_len, text_dim], zero beyond each prompt
    clip_feature: torch.Tensor         # [B, clip_tokens, clip_dim]
    y: torch.Tensor | None             # [B, 4 + z, F, h, w] for first-frame-concat models, else None


def video_to_unit_range(images: torch.Tensor, size: tuple[int, int] | None = None) -> torch.Tensor:
    """uint8 [B, T, H, W, 3] -> float [B, 3, T, H', W'] in [-1, 1], bilinear-resized to `size` if given."""
    if images.dim() != 5 or images.shape[-1] != 3:
        raise ValueError(f"expected images [B, T, H, W, 3], got {tuple(images.shape)}")
    B, T, H, W, _ = images.shape
    x = images.permute(0, 1, 4, 2, 3).reshape(B * T, 3, H, W).float() / 127.5 - 1
    if size is not None and (H, W) != tuple(size):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    return x.reshape(B, T, 3, *x.shape[-2:]).permute(0, 2, 1, 3, 4)


@torch.no_grad()
def encode_batch(args: DreamZeroArgs, vae, text_encoder, image_encoder, images: torch.Tensor,
                 text_ids: torch.Tensor, text_mask: torch.Tensor, image_size: tuple[int, int] | None = None) -> EncodedBatch:
    video = video_to_unit_range(images, image_size).to(next(vae.parameters()).dtype)
    latents = vae.encode(video)
    first = video[:, :, 0]
    clip = image_encoder.encode_images(first)
    context = zero_beyond_lengths(text_encoder(text_ids, text_mask), text_mask)
    y = None
    if args.concat_first_frame_latent:
        cond_video = torch.cat([video[:, :, :1], torch.zeros_like(video[:, :, 1:])], dim=2)
        y_lat = vae.encode(cond_video)
        msk = torch.zeros(y_lat.shape[0], 4, *y_lat.shape[2:], dtype=y_lat.dtype, device=y_lat.device)
        msk[:, :, 0] = 1
        y = torch.cat([msk, y_lat], dim=1)
    return EncodedBatch(clean_latents=latents, context=context, clip_feature=clip, y=y)
