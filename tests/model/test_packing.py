"""Sequence packing: samples of different layouts in one buffer attend exactly as each would alone."""

import pytest
import torch

from dzmodel.model.attention import SegmentedMask, TeacherForcingLayout, attention, teacher_forcing_mask
from dzmodel.model.packing import PackedLayout, pack_first_fit, packing_efficiency
from dzmodel.model.synthetic import training_sample

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


def _sample(args, latent_hw, blocks, seed):
    """One training sample (a batch of one) with its own frame size and chunk count, in float64."""
    return training_sample(args, latent_hw, torch.Generator().manual_seed(seed), dtype=torch.float64, blocks=blocks)


def test_a_packed_batch_gives_each_sample_its_own_outputs_losses_and_gradients():
    """Three samples of different frame sizes (two cameras side by side, three, one) and chunk counts, packed into
    one buffer with padding: every output equals the sample's alone, and so do the summed gradients."""
    from tests.model.helpers import tiny_model

    model = tiny_model().double()
    samples = [_sample(model.args, (4, 6), 2, 1), _sample(model.args, (4, 10), 2, 2), _sample(model.args, (2, 4), 1, 3)]

    def run(packed: bool):
        model.zero_grad()
        if packed:
            outs = model.forward_packed(samples, capacity=400)
        else:
            outs = [model(**s, attn_backend="segments") for s in samples]
        losses = [o.video_pred.square().mean() + o.action_pred.square().mean() for o in outs]
        sum(losses).backward()
        return outs, losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (p_out, p_loss, p_grad), (a_out, a_loss, a_grad) = run(True), run(False)
    for p, a in zip(p_out, a_out):
        assert p.video_pred.shape == a.video_pred.shape
        torch.testing.assert_close(p.video_pred, a.video_pred, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(p.action_pred, a.action_pred, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.stack(p_loss), torch.stack(a_loss), atol=1e-10, rtol=1e-10)
    assert p_grad.keys() == a_grad.keys() and len(a_grad) > 10
    for n in a_grad:  # norms and modulation compute in fp32 (WAN): their sums over tokens differ in fp32 order
        torch.testing.assert_close(p_grad[n], a_grad[n], atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_packing_refuses_a_batch_and_a_buffer_too_small():
    from tests.model.helpers import tiny_model

    model = tiny_model().double()
    one = _sample(model.args, (4, 6), 2, 1)
    two = {k: torch.cat([v, v]) for k, v in one.items()}
    with pytest.raises(ValueError, match="batch of 2: pack samples of one each"):
        model.forward_packed([two])
    with pytest.raises(ValueError, match="more than the buffer's 10"):
        model.forward_packed([one], capacity=10)


def test_the_flex_document_mask_gives_the_segments_outputs():
    """One FlexAttention call per layer over the packed buffer (document mask, and the contexts' owner mask) gives
    what the per-rectangle SDPA calls give, and its mask is the packed mask."""
    from tests.model.helpers import tiny_model

    packed = PackedLayout((LIBERO, DROID, HUMANOID), capacity=256)
    q_idx = torch.arange(packed.capacity)
    block = packed.block_mask("cpu")
    dense = block.mask_mod(0, 0, q_idx[:, None], q_idx[None, :])
    assert torch.equal(dense, packed.dense())
    model = tiny_model().double()
    samples = [_sample(model.args, (4, 6), 2, 1), _sample(model.args, (4, 10), 2, 2), _sample(model.args, (2, 4), 1, 3)]
    with torch.no_grad():
        seg = model.forward_packed(samples, capacity=400)
        flex = model.forward_packed(samples, capacity=400, attn_backend="flex")
    for a, b in zip(seg, flex):
        torch.testing.assert_close(b.video_pred, a.video_pred, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.action_pred, a.action_pred, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="packed attention runs 'segments' or 'flex'"):
        model.forward_packed(samples, attn_backend="sdpa")
