"""Sequence packing: samples of different layouts in one buffer attend exactly as each would alone."""

import pytest
import torch

from dzmodel.model.attention import SegmentedMask, TeacherForcingLayout, attention, teacher_forcing_mask
from dzmodel.model.packing import PackedLayout, pack_first_fit, packing_efficiency

# three embodiments' shapes: LIBERO-like (2 views), DROID-like (3 views, longer chunks), a humanoid (1 view, 1 block)
LIBERO = TeacherForcingLayout(num_blocks=2, frame_seqlen=8, num_frame_per_block=2, num_action_per_block=4,
                              num_state_per_block=1, clean_blocks=1)
DROID = TeacherForcingLayout(num_blocks=2, frame_seqlen=12, num_frame_per_block=2, num_action_per_block=6,
                             num_state_per_block=1, clean_blocks=1)
HUMANOID = TeacherForcingLayout(num_blocks=1, frame_seqlen=4, num_frame_per_block=2, num_action_per_block=3,
                                num_state_per_block=1, clean_blocks=0)


def test_a_packed_buffer_attends_like_each_sample_alone():
    packed = PackedLayout((LIBERO, DROID, HUMANOID), capacity=LIBERO.seq_len + DROID.seq_len + HUMANOID.seq_len + 5)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, packed.capacity, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = attention(q, k, v, packed.mask())
    assert torch.isfinite(out).all()  # the padding rows too
    for i, layout in enumerate(packed.layouts):
        s, e = packed.sample_rows(i)
        alone = attention(q[:, s:e], k[:, s:e], v[:, s:e], SegmentedMask.from_layout(layout))
        torch.testing.assert_close(out[:, s:e], alone, atol=1e-12, rtol=1e-12)
    # ... and a sample's rows do not change when another sample's tokens do
    k2 = k.clone()
    s, e = packed.sample_rows(1)
    k2[:, s:e] += torch.randn(k2[:, s:e].shape, generator=g, dtype=torch.float64)
    out2 = attention(q, k2, v, packed.mask())
    for i in (0, 2):
        a, b = packed.sample_rows(i)
        torch.testing.assert_close(out2[:, a:b], out[:, a:b], atol=0, rtol=0)
    assert not torch.allclose(out2[:, s:e], out[:, s:e])


def test_the_packed_mask_is_block_diagonal_with_each_samples_own_mask():
    packed = PackedLayout((DROID, HUMANOID, LIBERO), capacity=210)
    dense = packed.dense()
    expected = torch.zeros(210, 210, dtype=torch.bool)
    for i, layout in enumerate(packed.layouts):
        s, e = packed.sample_rows(i)
        expected[s:e, s:e] = teacher_forcing_mask(layout)
    expected[packed.used:, packed.used:] = True  # the padding attends only itself
    assert torch.equal(dense, expected)


def test_efficiency_and_refusals():
    packed = PackedLayout((LIBERO, HUMANOID), capacity=100)
    assert packed.used == LIBERO.seq_len + HUMANOID.seq_len
    assert packed.efficiency == pytest.approx(packed.used / 100)
    with pytest.raises(ValueError, match="more than the buffer's"):
        PackedLayout((LIBERO, DROID), capacity=LIBERO.seq_len)
    with pytest.raises(ValueError, match="at least one sample"):
        PackedLayout((), capacity=10)


def test_first_fit_places_every_sample_once_within_capacity():
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(20, 120, (200,), generator=g)]
    bins = pack_first_fit(lengths, capacity=256)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in bins)
    assert all(b == sorted(b) for b in bins)
    # first-fit decreasing on many small samples fills its buffers nearly full; padding each to the largest does not
    eff = packing_efficiency(lengths, bins, 256)
    assert eff >= 0.95
    padded = sum(lengths) / (len(lengths) * max(lengths))
    assert padded < 0.7


def test_a_sample_longer_than_a_buffer_is_refused_with_the_capacity_it_needs():
    with pytest.raises(ValueError, match="sample 1 has 300 tokens, more than a buffer of 256: raise the capacity to "
                                         "at least 300"):
        pack_first_fit([10, 300, 20], 256)
