"""Collate samples into the training batch contract (reference §4.6, without upstream's dead keys).

    images               uint8 [B, T, H, W, 3]
    state, state_mask    float32 [B, K, max_state_dim], bool (True on real dims)
    action, action_mask  float32 [B, K·H, max_action_dim] in [-1, 1], bool
    text                 int64 [B, text_len] token ids
    text_attention_mask  int64 [B, text_len]  -- per sample: the text encoder zeroes each prompt past its own length
    embodiment_id        int64 [B]
    has_real_action      bool [B]
    position             int64 [B]  the sample's global stream position (when the sampler provides it)
Samples that name their frames instead (`frame_refs`, `WindowDataset.decode_on_host = False`) give `frame_refs` and
`dataset` (lists, one entry per sample) in place of `images`, for `nvdec.VideoImages` to decode on the device.
Dropped: lapa_action(_mask), has_lapa_action, is_cotrain_instance, segmentation_target(_mask) (never read),
text_negative (only inference's CFG uses a negative prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .errors import DataError


@dataclass
class Collator:
    tokenizer: Any          # (texts, max_length) -> (ids, mask)
    text_len: int
    max_state_dim: int
    max_action_dim: int

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        if not samples:
            raise DataError("cannot collate an empty batch")
        refs = "frame_refs" in samples[0]  # frames named, to be decoded on the device (`nvdec.VideoImages`)
        shapes = {tuple(s["images"].shape) for s in samples} if not refs else set()
        if len(shapes) > 1:
            raise DataError(f"samples of one batch must share a frame shape, got {sorted(shapes)}")
        B = len(samples)
        K, S = samples[0]["state"].shape
        N, A = samples[0]["action"].shape
        if S > self.max_state_dim or A > self.max_action_dim:
            raise DataError(f"state {S} / action {A} dims exceed the model's max_state_dim {self.max_state_dim} / "
                            f"action_dim {self.max_action_dim}: set train.model_overrides "
                            f"{{max_state_dim: {max(S, self.max_state_dim)}, action_dim: {max(A, self.max_action_dim)}}} "
                            "(a pretrained preset keeps its checkpoint's widths: fewer dims than these fit)")
        state = torch.zeros(B, K, self.max_state_dim)
        action = torch.zeros(B, N, self.max_action_dim)
        state_mask = torch.zeros(B, K, self.max_state_dim, dtype=torch.bool)
        action_mask = torch.zeros(B, N, self.max_action_dim, dtype=torch.bool)
        for i, s in enumerate(samples):
            if tuple(s["state"].shape) != (K, S) or tuple(s["action"].shape) != (N, A):
                raise DataError("samples of one batch must share state/action shapes (one embodiment layout per batch)")
            state[i, :, :S] = s["state"]
            action[i, :, :A] = s["action"]
            state_mask[i, :, :S] = True
            action_mask[i, :, :A] = True
        text, text_mask = self.tokenizer([s["prompt"] for s in samples], max_length=self.text_len)
        images = ({"frame_refs": [s["frame_refs"] for s in samples], "dataset": [int(s["dataset"]) for s in samples]}
                  if refs else {"images": torch.stack([s["images"] for s in samples])})
        return {
            **images,
            "state": state, "state_mask": state_mask,
            "action": action, "action_mask": action_mask,
            "text": text.long(), "text_attention_mask": text_mask.long(),
            "embodiment_id": torch.tensor([int(s["embodiment_id"]) for s in samples], dtype=torch.long),
            "has_real_action": torch.tensor([bool(s["has_real_action"]) for s in samples], dtype=torch.bool),
            **({"position": torch.tensor([int(s["position"]) for s in samples], dtype=torch.long)}
               if all("position" in s for s in samples) else {}),
        }
