"""Model FLOPs per training sample (reference §3.3), for throughput and MFU reporting.

Forward FLOPs, counting a multiply-add as 2:
  per layer: linear  = 2·L·(4d² + 2d² + 2d·ffn) + 2·C'·2d²  (self qkvo, cross q/o, FFN; cross K/V on the C' context
                                                             rows projected: C, or the prompts' rows + 1 + CLIP's)
             self    = 4·d·P                                   (P = allowed (query, key) pairs of the mask)
             cross   = 4·d·L·C
  the last layer: the same for its R output rows (the noisy video and the actions, what the loss reads), with
             k and v of all L tokens: 2·L·2d² + 2·R·(2d² + 2d² + 2d·ffn) + 2·C·2d², 4·d·P_R, 4·d·R·C
  outside:   time MLP once per timestep group 2·T·(f·d + 7d²) (T = 1 + noisy frames + action + state tokens: what forward runs),
             text/CLIP embedders, patch conv, head, action/state MLPs.
Training model FLOPs = 3 × forward (backward = 2 × forward). Activation recompute is NOT counted
(that would be hardware FLOPs); `recompute=True` adds one more forward for reporting HFU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .attention import TeacherForcingLayout


@dataclass
class FlopsBreakdown:
    linear: float
    self_attn: float
    cross_attn: float
    outside: float

    @property
    def forward(self) -> float:
        return self.linear + self.self_attn + self.cross_attn + self.outside

    def train(self, recompute: bool = False) -> float:
        return self.forward * (4 if recompute else 3)


def allowed_pairs(layout: TeacherForcingLayout) -> int:
    """Closed form of the §1.6 mask's allowed pairs (checked against the dense mask in tests)."""
    fs, nfpb, K = layout.frame_seqlen, layout.num_frame_per_block, layout.num_blocks
    S = layout.num_state_per_block
    bs = nfpb * fs  # tokens per block
    clean = fs * fs + sum(bs * (fs + (i + 1) * bs) for i in range(layout.num_clean_blocks))
    state = K * S * S
    return clean + output_pairs(layout) + state


def output_pairs(layout: TeacherForcingLayout) -> int:
    """Allowed pairs whose query is an output row of the last layer (noisy video and actions)."""
    fs, nfpb, K = layout.frame_seqlen, layout.num_frame_per_block, layout.num_blocks
    A, S = layout.num_action_per_block, layout.num_state_per_block
    bs = nfpb * fs
    noisy0 = fs * fs if layout.noisy_first_frame else 0  # the noisy frame 0 attends itself
    return noisy0 + sum((bs + A) * (fs + i * bs + bs + A + S) for i in range(K))


def wam_forward_flops(args: Any, layout: TeacherForcingLayout, text_rows: int | None = None) -> FlopsBreakdown:
    """args: a DreamZeroArgs (not imported: `DreamZeroArgs.flops` calls this, so this module sits below args.py).
    text_rows: the forward's `text_rows` (the prompts' rows; K and V and the text embedding run on those and one
    zero row); the attention still reads all text_len keys."""
    d, ffn, n = args.dim, args.ffn_dim, args.num_layers
    L = layout.seq_len
    R = layout.video_len + layout.action_len  # the last layer's output rows
    C = args.text_len + args.clip_tokens
    rows = args.padded_text_rows(text_rows)
    text_projected = args.text_len if rows is None else rows + 1
    C_projected = text_projected + args.clip_tokens
    # a one-token state block attends only itself: its output is its value, and no attention is computed for it
    P = allowed_pairs(layout) - (layout.num_blocks if layout.num_state_per_block == 1 else 0)
    linear = ((n - 1) * 2 * L * (4 * d * d + 2 * d * d + 2 * d * ffn) + 2 * L * 2 * d * d
              + 2 * R * (2 * d * d + 2 * d * d + 2 * d * ffn) + n * 2 * C_projected * 2 * d * d)
    self_attn = (n - 1) * 4 * d * P + 4 * d * output_pairs(layout)
    cross_attn = (n - 1) * 4 * d * L * C + 4 * d * R * C
    patch = 2 * (layout.clean_len + layout.video_len) * args.in_dim * 4 * d * 1  # both copies; kernel (1,2,2)
    head = 2 * layout.video_len * d * 4 * args.out_dim
    # the time MLP runs once per group of tokens that share a timestep: the clean copy (one), each noisy latent
    # frame, and each action and state token; not once per token
    time_rows = 1 + layout.noisy_frames + layout.action_len + layout.state_len
    time_mlp = 2 * time_rows * (args.freq_dim * d + 7 * d * d)
    text = 2 * text_projected * (args.text_dim * d + d * d)
    image = 2 * args.clip_tokens * (args.clip_dim * args.clip_dim + args.clip_dim * d)
    action = 2 * layout.action_len * (args.action_dim * d + 2 * d * d + d * d + d * args.hidden_size + args.hidden_size * args.action_dim)
    state = 2 * layout.state_len * (args.max_state_dim * args.hidden_size + args.hidden_size * d)
    outside = patch + head + time_mlp + text + image + action + state
    return FlopsBreakdown(linear=linear, self_attn=self_attn, cross_attn=cross_attn, outside=outside)


