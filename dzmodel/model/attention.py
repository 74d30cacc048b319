"""Attention kernels and DreamZero's block-causal teacher-forcing mask (reference §1.6).

Upstream realises the mask as ~18 dense FlashAttention calls per layer on
concatenated K/V slices. Here it is one mask, so each layer makes ONE attention
call: a FlexAttention `BlockMask` on GPU (sparse blocks are skipped), or a dense
boolean mask for SDPA on CPU. Both come from the same per-token group table, so
they cannot disagree.

Token layout of one training sample ([clean video | noisy video | actions | states]):
    clean frame 0, clean blocks 0..K-1, noisy frame 0, noisy blocks 0..K-1,
    action blocks 0..K-1, state blocks 0..K-1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

try:  # FlexAttention exists in torch >= 2.5; the CPU path does not need it.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = flex_attention = None  # type: ignore[assignment]

AttnMask = Union[None, torch.Tensor, "BlockMask"]

# Group kinds in the per-token table.
CLEAN0, CLEAN, NOISY0, NOISY, ACTION, STATE = range(6)


@dataclass(frozen=True)
class TeacherForcingLayout:
    """Sizes of one teacher-forcing sequence."""

    num_blocks: int          # K
    frame_seqlen: int        # tokens per latent frame
    num_frame_per_block: int
    num_action_per_block: int  # A
    num_state_per_block: int   # S

    @property
    def num_frames(self) -> int:
        return 1 + self.num_blocks * self.num_frame_per_block

    @property
    def video_len(self) -> int:
        return self.num_frames * self.frame_seqlen

    @property
    def action_len(self) -> int:
        return self.num_blocks * self.num_action_per_block

    @property
    def state_len(self) -> int:
        return self.num_blocks * self.num_state_per_block

    @property
    def seq_len(self) -> int:
        return 2 * self.video_len + self.action_len + self.state_len

    def groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (kind, block) ids over the whole sequence. Frame 0 has block -1."""
        fs, nfpb = self.frame_seqlen, self.num_frame_per_block
        frame_block = torch.arange(self.num_frames).sub(1).div(nfpb, rounding_mode="floor")  # -1, 0,0, 1,1, ...
        video_block = frame_block.repeat_interleave(fs)
        video_kind = torch.where(video_block < 0, 0, 1)
        kinds = torch.cat([
            video_kind + CLEAN0,                       # CLEAN0 / CLEAN
            video_kind + NOISY0,                       # NOISY0 / NOISY
            torch.full((self.action_len,), ACTION),
            torch.full((self.state_len,), STATE),
        ])
        blocks = torch.cat([
            video_block, video_block,
            torch.arange(self.num_blocks).repeat_interleave(self.num_action_per_block),
            torch.arange(self.num_blocks).repeat_interleave(self.num_state_per_block),
        ])
        return kinds.long(), blocks.long()


def allowed(q_kind: torch.Tensor, q_block: torch.Tensor, k_kind: torch.Tensor, k_block: torch.Tensor) -> torch.Tensor:
    """The §1.6 table as a broadcastable predicate: may query (kind, block) attend key (kind, block)?

    | query          | keys                                                            |
    | clean frame 0  | itself                                                          |
    | clean block i  | clean frame 0 + clean blocks 0..i                               |
    | noisy frame 0  | itself                                                          |
    | noisy block i  | clean frame 0 + clean blocks < i + noisy/action/state block i   |
    | action block i | same as noisy block i                                           |
    | state block i  | itself                                                          |
    """
    k_clean = (k_kind == CLEAN0) | (k_kind == CLEAN)
    same_block = q_block == k_block
    clean_query = (q_kind == CLEAN0) | (q_kind == CLEAN)
    clean_rule = clean_query & k_clean & ((k_kind == CLEAN0) | ((q_kind == CLEAN) & (k_block <= q_block)))
    noisy0_rule = (q_kind == NOISY0) & (k_kind == NOISY0)
    k_current = ((k_kind == NOISY) | (k_kind == ACTION) | (k_kind == STATE)) & same_block
    k_history = (k_kind == CLEAN0) | ((k_kind == CLEAN) & (k_block < q_block))
    noisy_rule = ((q_kind == NOISY) | (q_kind == ACTION)) & (k_current | k_history)
    state_rule = (q_kind == STATE) & (k_kind == STATE) & same_block
    return clean_rule | noisy0_rule | noisy_rule | state_rule


def teacher_forcing_mask(layout: TeacherForcingLayout, device: torch.device | str = "cpu") -> torch.Tensor:
    """Dense [L, L] bool mask, mask[q, k] = True where query q attends key k (SDPA convention)."""
    kinds, blocks = (t.to(device) for t in layout.groups())
    return allowed(kinds[:, None], blocks[:, None], kinds[None, :], blocks[None, :])


def teacher_forcing_block_mask(layout: TeacherForcingLayout, device: torch.device | str = "cuda",
                               block_size: int = 128) -> "BlockMask":
    """The same mask as a FlexAttention BlockMask (one kernel, fully-masked tiles skipped)."""
    if create_block_mask is None:
        raise RuntimeError("FlexAttention needs torch >= 2.5")
    kinds, blocks = (t.to(device) for t in layout.groups())

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed(kinds[q_idx], blocks[q_idx], kinds[kv_idx], blocks[kv_idx])

    L = layout.seq_len
    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=L, KV_LEN=L, device=device, BLOCK_SIZE=block_size)


def count_allowed_pairs(layout: TeacherForcingLayout) -> int:
    """P in the reference's FLOPs formula (attention work = 4·d·P per layer)."""
    return int(teacher_forcing_mask(layout).sum())


_compiled_flex = None


def _flex(q, k, v, block_mask):
    global _compiled_flex
    if q.device.type == "cpu" or torch.compiler.is_compiling():
        # Inside a compiled block the call is traced into the block's graph. Creating the compiled wrapper
        # there instead would split the block's graph on the first trace (slower, more memory).
        return flex_attention(q, k, v, block_mask=block_mask)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttnMask = None) -> torch.Tensor:
    """Scaled dot-product attention on [B, L, H, D] tensors, returning [B, Lq, H, D].

    mask: None (full attention), a bool tensor broadcastable to [B, H, Lq, Lk]
    (True = attend), or a FlexAttention BlockMask.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if BlockMask is not None and isinstance(mask, BlockMask):
        out = _flex(q, k, v, mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)
