"""Sequence packing: the token sequences of several samples, of any embodiment, in one fixed-size buffer.

Each sample keeps its own teacher-forcing mask (attention.py) and attends nothing of the others, so a packed buffer
computes what each sample would alone, with the padding of a batch replaced by other samples. Samples of different
cameras, frame sizes and chunk lengths have sequences of different lengths; `pack_first_fit` places them into
buffers of `capacity` tokens, and `PackedLayout` gives the buffer's mask as dense rectangles (one SDPA call per
rectangle, as `SegmentedMask` does for one sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import BlockMask, SegmentedMask, TeacherForcingLayout, allowed, create_block_mask


def _shift(ranges: tuple, offset: int) -> tuple:
    return tuple((s + offset, e + offset) for s, e in ranges)


@dataclass(frozen=True)
class PackedLayout:
    """Samples laid out one after another in a buffer of `capacity` tokens; the tail is padding."""

    layouts: tuple[TeacherForcingLayout, ...]
    capacity: int

    def __post_init__(self) -> None:
        if not self.layouts:
            raise ValueError("a packed buffer needs at least one sample")
        if self.used > self.capacity:
            raise ValueError(f"the samples hold {self.used} tokens, more than the buffer's {self.capacity}")

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each sample's tokens start."""
        out, at = [], 0
        for layout in self.layouts:
            out.append(at)
            at += layout.seq_len
        return tuple(out)

    @property
    def used(self) -> int:
        return sum(layout.seq_len for layout in self.layouts)

    @property
    def efficiency(self) -> float:
        """Useful tokens / computed tokens."""
        return self.used / self.capacity

    def sample_rows(self, i: int) -> tuple[int, int]:
        start = self.offsets[i]
        return start, start + self.layouts[i].seq_len

    def mask(self) -> SegmentedMask:
        """The buffer's mask: every sample's rectangles moved to its offset; the padding attends only itself, so its
        rows stay finite and no sample attends them."""
        groups, self_ranges = [], []
        for layout, offset in zip(self.layouts, self.offsets):
            plan = SegmentedMask.from_layout(layout)
            groups += [(_shift(q, offset), _shift(k, offset)) for q, k in plan.groups]
            self_ranges += _shift(plan.self_ranges, offset)
        if self.capacity > self.used:
            self_ranges.append((self.used, self.capacity))
        return SegmentedMask(self.capacity, tuple(groups), tuple(self_ranges))

    def dense(self) -> torch.Tensor:
        """The same mask as a dense [capacity, capacity] bool tensor."""
        return self.mask().dense()

    def token_table(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per token of the buffer: (sample, kind, block); the padding is sample -1 (kind and block 0)."""
        samples, kinds, blocks = [], [], []
        for i, layout in enumerate(self.layouts):
            k, b = layout.groups()
            samples.append(torch.full_like(k, i))
            kinds.append(k)
            blocks.append(b)
        pad = self.capacity - self.used
        samples.append(torch.full((pad,), -1, dtype=torch.long))
        kinds.append(torch.zeros(pad, dtype=torch.long))
        blocks.append(torch.zeros(pad, dtype=torch.long))
        return torch.cat(samples), torch.cat(kinds), torch.cat(blocks)

    def block_mask(self, device: torch.device | str = "cuda", block_size: int = 128) -> "BlockMask":
        """The buffer's mask as one FlexAttention BlockMask (a document mask over the samples' own masks): one
        kernel per layer, the empty tiles between samples skipped."""
        if create_block_mask is None:
            raise RuntimeError("FlexAttention needs torch >= 2.5")
        sample, kind, block = (t.to(device) for t in self.token_table())

        def mask_mod(b, h, q_idx, kv_idx):
            same = sample[q_idx] == sample[kv_idx]
            pad = sample[q_idx] < 0
            return same & (pad | allowed(kind[q_idx], block[q_idx], kind[kv_idx], block[kv_idx]))

        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=self.capacity, KV_LEN=self.capacity, device=device,
                                 BLOCK_SIZE=block_size)

    def _check_contexts(self, context_lengths: Sequence[int]) -> None:
        if len(context_lengths) != len(self.layouts):
            raise ValueError(f"{len(self.layouts)} samples, {len(context_lengths)} context lengths")

    def context_block_mask(self, context_lengths: Sequence[int], device: torch.device | str = "cuda",
                           block_size: int = 128) -> "BlockMask":
        """`context_mask` as a FlexAttention BlockMask."""
        self._check_contexts(context_lengths)
        sample = self.token_table()[0].clamp(min=0).to(device)  # the padding attends the first sample's context
        owner = torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(context_lengths)]).to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return sample[q_idx] == owner[kv_idx]

        return create_block_mask(mask_mod, B=None, H=None, Q_LEN=self.capacity, KV_LEN=int(sum(context_lengths)),
                                 device=device, BLOCK_SIZE=block_size)

    def context_mask(self, context_lengths: Sequence[int]) -> SegmentedMask:
        """The cross-attention's mask over the samples' contexts laid one after another (`context_lengths` tokens
        each): every sample's rows attend its own context only; the padding's rows attend the first sample's
        (their outputs are never read, but must stay finite)."""
        self._check_contexts(context_lengths)
        starts = [sum(context_lengths[:i]) for i in range(len(context_lengths))]
        groups = [((self.sample_rows(i),), ((c, c + n),)) for i, (c, n) in enumerate(zip(starts, context_lengths))]
        if self.capacity > self.used:
            groups.append((((self.used, self.capacity),), ((0, context_lengths[0]),)))
        return SegmentedMask(sum(context_lengths), tuple(groups), (), (0, self.capacity))


def pack_first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sample indices per buffer, longest first, each into the first buffer with room (first-fit decreasing).
    Within a buffer the samples keep their given order."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} tokens, more than a buffer of {capacity}: raise the capacity to at "
                         f"least {max(n for _, n in too_long)}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return [sorted(b) for b in bins]


def packing_efficiency(lengths: Sequence[int], bins: Sequence[Sequence[int]], capacity: int) -> float:
    """Useful tokens / computed tokens over all buffers."""
    return sum(lengths) / (capacity * len(bins)) if bins else 0.0
