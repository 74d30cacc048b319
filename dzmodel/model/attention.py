"""Attention kernels and DreamZero's block-causal teacher-forcing mask (reference §1.6).

Upstream realises the mask as ~18 dense FlashAttention calls per layer on
concatenated K/V slices. Here the mask is defined once, by a per-token group
table, and run three ways that tests hold equal:
  segments  (GPU default) the mask's dense rectangles, one unmasked SDPA call per
            query group (cuDNN / flash kernels; nothing computed then masked);
  flex      one FlexAttention call per layer with a `BlockMask` (empty tiles skipped);
  sdpa      one SDPA call with a dense boolean mask (the CPU default).

Token layout of one training sample ([clean video | noisy video | actions | states]):
    clean frame 0, clean blocks 0..K-2 (or K-1), noisy frame 0 (optional), noisy blocks 0..K-1,
    action blocks 0..K-1, state blocks 0..K-1

Training drops the last clean block: only clean blocks attend it, and the loss reads no clean output, so it changes
no output or gradient (tests hold the two equal) while costing 1/5 of the small preset's tokens.
The noisy copy of frame 0 attends only itself and nothing attends it: it is a loss term of its own (denoise the
first frame from the text and CLIP image), which inference never runs. `noisy_first_frame=False` leaves it out
(`train.denoise_first_frame: false`); the other tokens' outputs are unchanged, the gradients lose that term.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F

try:  # FlexAttention exists in torch >= 2.5; the CPU path does not need it.
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
    create_block_mask = flex_attention = None  # type: ignore[assignment]

AttnMask = Union[None, torch.Tensor, "BlockMask", "SegmentedMask"]

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
    clean_blocks: int | None = None  # clean blocks in the sequence: K (None) or K - 1 (`latent_layout`)
    noisy_first_frame: bool = True   # the noisy copy holds frame 0 (upstream), or starts at block 0

    def __post_init__(self) -> None:
        if self.clean_blocks is not None and not 0 <= self.clean_blocks <= self.num_blocks:
            raise ValueError(f"clean_blocks must be in [0, {self.num_blocks}], got {self.clean_blocks}")

    @property
    def num_frames(self) -> int:
        return 1 + self.num_blocks * self.num_frame_per_block

    @property
    def noisy_frames(self) -> int:
        """Latent frames in the noisy copy: every frame, or all but frame 0."""
        return self.num_frames - (0 if self.noisy_first_frame else 1)

    @property
    def video_len(self) -> int:
        """Tokens of the noisy video copy."""
        return self.noisy_frames * self.frame_seqlen

    @property
    def num_clean_blocks(self) -> int:
        return self.num_blocks if self.clean_blocks is None else self.clean_blocks

    @property
    def clean_frames(self) -> int:
        return 1 + self.num_clean_blocks * self.num_frame_per_block

    @property
    def clean_len(self) -> int:
        """Tokens of the clean video copy."""
        return self.clean_frames * self.frame_seqlen

    @property
    def action_len(self) -> int:
        return self.num_blocks * self.num_action_per_block

    @property
    def state_len(self) -> int:
        return self.num_blocks * self.num_state_per_block

    @property
    def seq_len(self) -> int:
        return self.clean_len + self.video_len + self.action_len + self.state_len

    def groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (kind, block) ids over the whole sequence. Frame 0 has block -1."""
        fs, nfpb = self.frame_seqlen, self.num_frame_per_block
        frame_block = torch.arange(self.num_frames).sub(1).div(nfpb, rounding_mode="floor")  # -1, 0,0, 1,1, ...
        video_block = frame_block.repeat_interleave(fs)
        video_kind = torch.where(video_block < 0, 0, 1)
        clean_block, clean_kind = video_block[:self.clean_len], video_kind[:self.clean_len]
        skip = 0 if self.noisy_first_frame else fs  # the noisy copy's first token
        kinds = torch.cat([
            clean_kind + CLEAN0,                       # CLEAN0 / CLEAN
            video_kind[skip:] + NOISY0,                # NOISY0 / NOISY
            torch.full((self.action_len,), ACTION),
            torch.full((self.state_len,), STATE),
        ])
        blocks = torch.cat([
            clean_block, video_block[skip:],
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


def latent_layout(args, latent_hw: tuple[int, int], num_frames: int | None = None, *,
                  keep_last_clean_block: bool = False, noisy_first_frame: bool = True) -> TeacherForcingLayout:
    """The one conversion from latents to the token layout: a latent frame's (H, W) before patching, and the latent
    frames of the sample (default: the training window, frame 0 plus max_chunk_size blocks). args: DreamZeroArgs.
    The last clean block is left out (see the module docstring) unless `keep_last_clean_block` (upstream's
    sequence, for comparing masks); the noisy copy of frame 0 likewise if not `noisy_first_frame`."""
    nfpb, p = args.num_frame_per_block, args.patch_size
    if not noisy_first_frame and p[0] != 1:
        raise ValueError(f"leaving out the noisy first frame needs a temporal patch of 1, got patch_size {p}")
    num_frames = 1 + nfpb * args.max_chunk_size if num_frames is None else num_frames // p[0]
    if (num_frames - 1) % nfpb or num_frames < 1 + nfpb:
        raise ValueError(f"latent frames must be 1 + k·{nfpb} (k >= 1), got {num_frames}")
    blocks = (num_frames - 1) // nfpb
    return TeacherForcingLayout(num_blocks=blocks, frame_seqlen=(latent_hw[0] // p[1]) * (latent_hw[1] // p[2]),
                                num_frame_per_block=nfpb, num_action_per_block=args.num_action_per_block,
                                num_state_per_block=args.num_state_per_block,
                                clean_blocks=None if keep_last_clean_block else blocks - 1,
                                noisy_first_frame=noisy_first_frame)


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


@dataclass(frozen=True)
class SegmentedMask:
    """The §1.6 mask as dense rectangles: every query group attends one set of key ranges with no mask inside,
    so each group is one plain SDPA call (cuDNN / FlashAttention kernels, nothing computed and then masked).

    groups: ((query ranges), (key ranges)) per call, ranges as (start, end) token positions; a group's queries
    are concatenated in the order given, and so are its keys. `self_ranges`: ranges that attend only themselves
    (clean and noisy frame 0, the state blocks); those of one length share one call, batched, and a range of one
    token is its own value (a softmax over one key is exactly 1), with no call at all.
    `query_rows`: the token rows that are queries ((0, seq_len): all; `for_queries` narrows it): the query
    tensor holds these rows only, the keys and values every token.
    """

    seq_len: int
    groups: tuple
    self_ranges: tuple
    query_rows: tuple[int, int] | None = None

    @property
    def rows(self) -> tuple[int, int]:
        return self.query_rows or (0, self.seq_len)

    def for_queries(self, start: int, end: int) -> "SegmentedMask":
        """The same mask for the queries of rows [start, end) only (keys: every token). A self-attending range that
        the rows cut becomes a group: its queries inside the rows, against all of its keys."""
        if torch.compiler.is_compiling():  # traced once into the graph (the compiler ignores an lru_cache, noisily)
            return self._for_queries(start, end)
        return self._cached_for_queries(start, end)

    @functools.lru_cache(maxsize=8)  # one object per row range: a compiled block sees the same constant each step
    def _cached_for_queries(self, start: int, end: int) -> "SegmentedMask":
        return self._for_queries(start, end)

    def _for_queries(self, start: int, end: int) -> "SegmentedMask":
        if not 0 <= start < end <= self.seq_len:
            raise ValueError(f"query rows must lie in [0, {self.seq_len}], got [{start}, {end})")
        clip = lambda ranges: tuple((max(s, start), min(e, end)) for s, e in ranges if min(e, end) > max(s, start))  # noqa: E731
        groups = [(clip(q), k) for q, k in self.groups if clip(q)]
        inside = tuple((s, e) for s, e in self.self_ranges if start <= s and e <= end)
        groups += [(clip(((s, e),)), ((s, e),)) for s, e in self.self_ranges
                   if (s, e) not in inside and clip(((s, e),))]
        return SegmentedMask(self.seq_len, tuple(groups), inside, (start, end))

    @staticmethod
    def from_layout(layout: TeacherForcingLayout) -> "SegmentedMask":
        fs, bs, K = layout.frame_seqlen, layout.num_frame_per_block * layout.frame_seqlen, layout.num_blocks
        A, S, V = layout.num_action_per_block, layout.num_state_per_block, layout.video_len
        C = layout.clean_len  # the noisy copy starts here
        R = C + V             # ... and the actions, then the states, here
        f0 = fs if layout.noisy_first_frame else 0  # the noisy copy's frame 0
        groups = [(((fs + i * bs, fs + (i + 1) * bs),), ((0, fs + (i + 1) * bs),))  # clean block i
                  for i in range(layout.num_clean_blocks)]
        for i in range(K):                                                    # noisy + action block i
            noisy = (C + f0 + i * bs, C + f0 + (i + 1) * bs)
            action = (R + i * A, R + (i + 1) * A)
            state = (R + K * A + i * S, R + K * A + (i + 1) * S)
            groups.append(((noisy, action), ((0, fs + i * bs), noisy, action, state)))
        frame0 = ((0, fs), (C, C + f0)) if f0 else ((0, fs),)                 # clean and noisy frame 0
        states = tuple((R + K * A + i * S, R + K * A + (i + 1) * S) for i in range(K)) if S else ()
        return SegmentedMask(layout.seq_len, tuple(groups), frame0 + states)

    def dense(self) -> torch.Tensor:
        """The same mask as a dense [query rows, L] bool tensor (tests compare it with `teacher_forcing_mask`)."""
        m = torch.zeros(max(self.seq_len, self.rows[1]), self.seq_len, dtype=torch.bool)
        for q_ranges, k_ranges in self.groups:
            for qs, qe in q_ranges:
                for ks, ke in k_ranges:
                    m[qs:qe, ks:ke] = True
        for s, e in self.self_ranges:
            m[s:e, s:e] = True
        start, end = self.rows
        return m[start:end]

    def self_calls(self) -> dict[int, tuple]:
        """The self-attending ranges by length: {length: ranges}, one batched call per length above 1."""
        by_length: dict[int, list] = {}
        for s, e in self.self_ranges:
            if e > s:
                by_length.setdefault(e - s, []).append((s, e))
        return {n: tuple(r) for n, r in by_length.items()}


def _take(x: torch.Tensor, ranges) -> torch.Tensor:
    """x [B, H, L, D]: the rows of `ranges` along L, concatenated (a view when there is one range)."""
    parts = [x[:, :, s:e] for s, e in ranges if e > s]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranges,
                    q0: int = 0) -> list[tuple[int, torch.Tensor]]:
    """Ranges of one length that each attend only themselves, as one call with the ranges stacked on the batch
    dim ([B, H, n, D] each -> [R·B, H, n, D]); one-token ranges return their values (the softmax is exactly 1).
    q holds the rows from q0 on."""
    n = ranges[0][1] - ranges[0][0]
    if n == 1:
        return [(s, v[:, :, s:e]) for s, e in ranges]
    if len(ranges) == 1:
        (s, e), = ranges
        return [(s, F.scaled_dot_product_attention(q[:, :, s - q0:e - q0], k[:, :, s:e], v[:, :, s:e]))]
    stack = lambda x, o: torch.cat([x[:, :, s - o:e - o] for s, e in ranges], dim=0)  # noqa: E731
    out = F.scaled_dot_product_attention(stack(q, q0), stack(k, 0), stack(v, 0)).chunk(len(ranges), dim=0)
    return [(s, o) for (s, _), o in zip(ranges, out)]


def segmented_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentedMask) -> torch.Tensor:
    """Attention under the teacher-forcing mask as one unmasked SDPA call per query group. q [B, H, rows, D]
    (the plan's query rows), k and v [B, H, L, D]."""
    q0, q1 = plan.rows
    if k.shape[2] != plan.seq_len or q.shape[2] != q1 - q0:
        raise ValueError(f"segmented mask is for {plan.seq_len} keys and {q1 - q0} queries, got "
                         f"{k.shape[2]} and {q.shape[2]}")
    pieces: list[tuple[int, torch.Tensor]] = []  # (start position, output rows)
    for q_ranges, k_ranges in plan.groups:
        shifted = tuple((s - q0, e - q0) for s, e in q_ranges)
        out = F.scaled_dot_product_attention(_take(q, shifted), _take(k, k_ranges), _take(v, k_ranges))
        offset = 0
        for s, e in q_ranges:
            pieces.append((s, out[:, :, offset:offset + e - s]))
            offset += e - s
    for ranges in plan.self_calls().values():
        pieces += _self_attention(q, k, v, ranges, q0)
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p[1] for p in pieces], dim=2)


def narrows_queries(mask: AttnMask) -> bool:
    """Whether `mask_for_queries` can narrow this kind of mask (a FlexAttention BlockMask it cannot)."""
    return mask is None or isinstance(mask, (SegmentedMask, torch.Tensor))


def mask_for_queries(mask: AttnMask, start: int, end: int) -> AttnMask:
    """The mask for the queries of token rows [start, end) only, against every key."""
    if mask is None:
        return None
    if isinstance(mask, SegmentedMask):
        return mask.for_queries(start, end)
    if isinstance(mask, torch.Tensor):
        return mask[..., start:end, :]
    raise ValueError(f"a {type(mask).__name__} cannot be narrowed to query rows (`narrows_queries`)")


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
    (True = attend), a FlexAttention BlockMask, or a SegmentedMask.
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if isinstance(mask, SegmentedMask):
        out = segmented_attention(q, k, v, mask)
    elif BlockMask is not None and isinstance(mask, BlockMask):
        out = _flex(q, k, v, mask)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2)
