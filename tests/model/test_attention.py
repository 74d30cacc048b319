"""The block-causal teacher-forcing mask: the §1.6 table, the fixture, FlexAttention vs SDPA."""

import pytest
import torch
from safetensors.torch import load_file

from dzmodel.model.attention import (SegmentedMask, TeacherForcingLayout, attention, count_allowed_pairs,
                                     mask_for_queries, teacher_forcing_block_mask, teacher_forcing_mask)
from dzmodel.model.flops import allowed_pairs

FIXTURE_LAYOUT = TeacherForcingLayout(num_blocks=2, frame_seqlen=6, num_frame_per_block=2,
                                      num_action_per_block=4, num_state_per_block=1)


def test_mask_equals_the_fixture_mask(fixtures_dir):
    ref = load_file(str(fixtures_dir / "dreamzero_wam_tiny_reference.safetensors"))["output.attention_mask"]
    mask = teacher_forcing_mask(FIXTURE_LAYOUT)
    assert mask.shape == ref.shape == (70, 70)
    assert torch.equal(mask, ref.bool())


def test_mask_rows_follow_the_table():
    m = teacher_forcing_mask(FIXTURE_LAYOUT)
    clean0, clean_b0, clean_b1 = slice(0, 6), slice(6, 18), slice(18, 30)
    noisy0, noisy_b0, noisy_b1 = slice(30, 36), slice(36, 48), slice(48, 60)
    act_b0, act_b1, st_b0, st_b1 = slice(60, 64), slice(64, 68), 68, 69

    def keys(row):
        return set(torch.nonzero(m[row]).flatten().tolist())

    rng = lambda s: set(range(s.start, s.stop))  # noqa: E731
    assert keys(0) == rng(clean0)
    assert keys(clean_b1.start) == rng(clean0) | rng(clean_b0) | rng(clean_b1)
    assert keys(noisy0.start) == rng(noisy0)
    assert keys(noisy_b1.start) == rng(clean0) | rng(clean_b0) | rng(noisy_b1) | rng(act_b1) | {st_b1}
    assert keys(act_b0.start) == rng(clean0) | rng(noisy_b0) | rng(act_b0) | {st_b0}
    assert keys(st_b1) == {st_b1}
    # only clean queries see the last clean block
    assert not m[36:, clean_b1].any()


@pytest.mark.parametrize("layout", [
    FIXTURE_LAYOUT,
    TeacherForcingLayout(4, 50, 2, 24, 1),
    TeacherForcingLayout(3, 7, 2, 5, 2),
    TeacherForcingLayout(2, 4, 1, 3, 1),
    TeacherForcingLayout(4, 50, 2, 24, 1, clean_blocks=3),  # the training sequence: no last clean block
    TeacherForcingLayout(2, 4, 1, 3, 1, clean_blocks=1),
    TeacherForcingLayout(2, 128, 2, 16, 1, clean_blocks=1, noisy_first_frame=False),  # libero_object, trimmed
    TeacherForcingLayout(3, 7, 2, 5, 2, noisy_first_frame=False),
])
def test_closed_form_pair_count_matches_the_dense_mask(layout):
    assert allowed_pairs(layout) == count_allowed_pairs(layout)


def test_pair_counts_match_the_reference():
    assert allowed_pairs(TeacherForcingLayout(4, 50, 2, 24, 1)) == 286_204      # 5B DROID
    assert allowed_pairs(TeacherForcingLayout(4, 880, 2, 24, 1)) == 76_576_484  # 14B DROID
    assert count_allowed_pairs(FIXTURE_LAYOUT) == 1578


def test_every_query_attends_something():
    for layout in (FIXTURE_LAYOUT, TeacherForcingLayout(3, 5, 2, 4, 1)):
        assert teacher_forcing_mask(layout).any(dim=1).all()


def test_flex_attention_and_sdpa_agree_with_each_other_and_the_mask():
    torch.manual_seed(0)
    layout = TeacherForcingLayout(2, 6, 2, 4, 1)
    L = layout.seq_len
    q, k, v = (torch.randn(2, L, 3, 16) for _ in range(3))
    dense = teacher_forcing_mask(layout)
    block = teacher_forcing_block_mask(layout, device="cpu", block_size=16)
    out_sdpa = attention(q, k, v, dense)
    with torch.no_grad():
        out_flex = attention(q, k, v, block)
    torch.testing.assert_close(out_flex, out_sdpa, atol=1e-5, rtol=1e-5)
    # the reference: explicit softmax over allowed keys only
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    scores = scores.masked_fill(~dense, float("-inf"))
    ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    torch.testing.assert_close(out_sdpa, ref, atol=1e-5, rtol=1e-5)
    # the BlockMask, expanded element-wise, is the dense mask
    from torch.nn.attention.flex_attention import create_mask

    kinds, blocks = layout.groups()
    from dzmodel.model.attention import allowed

    elem = create_mask(lambda b, h, qi, ki: allowed(kinds[qi], blocks[qi], kinds[ki], blocks[ki]), None, None, L, L, device="cpu")
    assert torch.equal(elem[0, 0], dense)


SEGMENT_LAYOUTS = [FIXTURE_LAYOUT, TeacherForcingLayout(4, 5, 2, 3, 1), TeacherForcingLayout(3, 7, 1, 4, 2),
                   TeacherForcingLayout(1, 3, 2, 2, 1), TeacherForcingLayout(2, 4, 2, 6, 3),
                   TeacherForcingLayout(2, 4, 1, 3, 0),  # no state tokens
                   TeacherForcingLayout(2, 6, 2, 4, 1, clean_blocks=1), TeacherForcingLayout(3, 7, 1, 4, 2, clean_blocks=2),
                   TeacherForcingLayout(1, 3, 2, 2, 1, clean_blocks=0),
                   TeacherForcingLayout(2, 6, 2, 4, 1, clean_blocks=1, noisy_first_frame=False),
                   TeacherForcingLayout(3, 7, 1, 4, 2, noisy_first_frame=False)]


@pytest.mark.parametrize("layout", [FIXTURE_LAYOUT, TeacherForcingLayout(3, 7, 1, 4, 2), TeacherForcingLayout(1, 3, 2, 2, 1)])
def test_training_mask_is_the_whole_mask_without_the_last_clean_block(layout):
    """Nothing outside the last clean block attends it: removing its rows and columns leaves the rest as is."""
    trimmed = TeacherForcingLayout(layout.num_blocks, layout.frame_seqlen, layout.num_frame_per_block,
                                   layout.num_action_per_block, layout.num_state_per_block,
                                   clean_blocks=layout.num_blocks - 1)
    block = layout.num_frame_per_block * layout.frame_seqlen
    whole = teacher_forcing_mask(layout)
    last = torch.zeros(layout.seq_len, dtype=torch.bool)
    last[layout.clean_len - block:layout.clean_len] = True
    assert not whole[~last][:, last].any()
    assert trimmed.seq_len == layout.seq_len - block
    assert torch.equal(teacher_forcing_mask(trimmed), whole[~last][:, ~last])


@pytest.mark.parametrize("layout", [FIXTURE_LAYOUT, TeacherForcingLayout(3, 7, 1, 4, 2),
                                    TeacherForcingLayout(2, 6, 2, 4, 1, clean_blocks=1)])
def test_mask_without_the_noisy_first_frame_is_the_mask_without_its_rows_and_columns(layout):
    """The noisy frame 0 attends only itself and nothing else attends it: leaving it out removes its rows and
    columns and leaves every other pair as it was."""
    from dataclasses import replace

    without = replace(layout, noisy_first_frame=False)
    whole = teacher_forcing_mask(layout)
    noisy0 = torch.zeros(layout.seq_len, dtype=torch.bool)
    noisy0[layout.clean_len:layout.clean_len + layout.frame_seqlen] = True
    assert not whole[~noisy0][:, noisy0].any() and not whole[noisy0][:, ~noisy0].any()
    assert without.seq_len == layout.seq_len - layout.frame_seqlen
    assert without.noisy_frames == layout.num_frames - 1
    assert torch.equal(teacher_forcing_mask(without), whole[~noisy0][:, ~noisy0])


def test_layout_refuses_more_clean_blocks_than_blocks():
    with pytest.raises(ValueError, match="clean_blocks"):
        TeacherForcingLayout(2, 4, 1, 3, 1, clean_blocks=3)


@pytest.mark.parametrize("layout", SEGMENT_LAYOUTS)
def test_segmented_mask_covers_exactly_the_allowed_pairs(layout):
    plan = SegmentedMask.from_layout(layout)
    assert torch.equal(plan.dense(), teacher_forcing_mask(layout))
    # every query belongs to exactly one call: no row computed twice, none left out
    rows = torch.zeros(layout.seq_len, dtype=torch.long)
    for q_ranges, _ in plan.groups:
        for s, e in q_ranges:
            rows[s:e] += 1
    for s, e in plan.self_ranges:
        rows[s:e] += 1
    assert torch.equal(rows, torch.ones_like(rows))


@pytest.mark.parametrize("layout", SEGMENT_LAYOUTS)
def test_segmented_attention_equals_the_masked_reference_with_gradients(layout):
    torch.manual_seed(0)
    L = layout.seq_len
    q, k, v = (torch.randn(2, L, 3, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    seg = attention(q, k, v, SegmentedMask.from_layout(layout))
    ref = attention(q, k, v, teacher_forcing_mask(layout))
    torch.testing.assert_close(seg, ref, atol=1e-12, rtol=1e-12)
    w = torch.randn_like(seg)
    g_seg = torch.autograd.grad((seg * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_seg, g_ref):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_segmented_attention_calls_sdpa_once_per_key_set(monkeypatch):
    """The small preset's training layout (2 blocks, the last clean one left out, 1 state token per block): one
    call per clean or noisy block, one for both frame-0 copies together, none for the one-token state blocks."""
    import torch.nn.functional as F_

    import dzmodel.model.attention as attention_module
    calls = []
    real = F_.scaled_dot_product_attention
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append(tuple(q.shape)) or real(q, k, v, **kw))
    layout = TeacherForcingLayout(2, 8, 2, 4, 1, clean_blocks=1)
    q = torch.randn(3, layout.seq_len, 2, 4)
    attention(q, q, q, SegmentedMask.from_layout(layout))
    assert len(calls) == 4, calls  # clean block 0, noisy blocks 0 and 1, frame 0 (clean + noisy, batch 2·3)
    assert (6, 2, 8, 4) in calls


def test_segmented_attention_refuses_another_length():
    plan = SegmentedMask.from_layout(FIXTURE_LAYOUT)
    q = torch.randn(1, FIXTURE_LAYOUT.seq_len + 1, 2, 4)
    with pytest.raises(ValueError, match="segmented mask is for 70 keys and 70 queries, got 71 and 71"):
        attention(q, q, q, plan)


@pytest.mark.parametrize("rows", [(0, 70), (10, 70), (22, 61), (5, 6), (69, 70)])
def test_a_segmented_mask_narrowed_to_query_rows_is_those_rows_of_the_mask_and_attends_alike(rows):
    plan = SegmentedMask.from_layout(FIXTURE_LAYOUT)
    narrowed = plan.for_queries(*rows)
    assert plan.for_queries(*rows) is narrowed  # one object per row range (a compiled block's constant)
    torch.testing.assert_close(narrowed.dense(), plan.dense()[rows[0]:rows[1]])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, FIXTURE_LAYOUT.seq_len, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    full = attention(q, k, v, plan)
    part = attention(q[:, rows[0]:rows[1]], k, v, narrowed)
    torch.testing.assert_close(part, full[:, rows[0]:rows[1]], atol=1e-12, rtol=1e-12)
    dense = attention(q[:, rows[0]:rows[1]], k, v, mask_for_queries(plan.dense(), *rows))
    torch.testing.assert_close(dense, part, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="query rows must lie in"):
        plan.for_queries(0, FIXTURE_LAYOUT.seq_len + 1)
