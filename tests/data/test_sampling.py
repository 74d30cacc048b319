"""Windows stay aligned with action chunks; anchors, mixtures and the resumable sharded stream."""

import numpy as np
import pytest

from dzmodel.data.embodiments import load_embodiments
from dzmodel.data.errors import DataError
from dzmodel.data.sampling import AnchorIndex, SampleStream, Segment, WindowSpec, task_segments


@pytest.mark.parametrize("tag", ["libero_sim", "oxe_droid", "franka_pnp"])
def test_every_builtin_embodiment_keeps_video_blocks_aligned_with_action_chunks(tag):
    emb = load_embodiments()[tag]
    H = emb.action_horizon
    spec = WindowSpec(num_chunks=4, action_horizon=H, frames_per_chunk=8)
    idx = AnchorIndex([Segment(0, 0, 300)], spec)
    for anchor in (0, 37, 150, 299):
        w = idx.window(anchor)
        assert len(w.frames) == 33 and np.all(np.diff(w.frames) > 0)  # strictly increasing: no interleaving
        assert w.frames[0] == w.start == w.state_rows[0]
        for c in range(4):
            block = w.frames[1 + 8 * c: 9 + 8 * c]  # the 8 video frames of latent block c
            chunk = w.action_rows[c * H:(c + 1) * H]
            assert block.min() > chunk.min() and block.max() == chunk.max() + 1
            assert w.state_rows[c] == chunk[0]
        assert 0 <= w.start and w.frames[-1] <= 299


def test_upstream_droid_offsets_are_reproduced_and_libero_is_fixed():
    assert WindowSpec(4, 24).video_offsets().tolist() == list(range(0, 97, 3))
    libero = WindowSpec(4, 16).video_offsets()
    assert libero.tolist() == list(range(0, 65, 2))  # upstream gave 0,3,6,...,15,16,18,19,21,... (interleaved)


def test_multi_anchor_places_the_window_around_the_anchor_and_inside_the_segment():
    spec = WindowSpec(4, 10)
    idx = AnchorIndex([Segment(3, 0, 100)], spec)
    assert len(idx) == 100  # every frame is an anchor
    w = idx.window(50)
    assert w.start == 30 and w.episode == 3  # two chunks back
    assert idx.window(5).start == 5 - 0  # can't go back a whole chunk
    assert idx.window(99).start == 100 - 1 - 40  # shifted to fit
    for a in range(100):
        w = idx.window(a)
        assert w.start <= a <= w.start + 40 or a > 59


def test_fixed_window_starts_at_the_anchor_and_skips_late_anchors():
    idx = AnchorIndex([Segment(0, 0, 50), Segment(1, 0, 20)], WindowSpec(2, 10, mode="fixed_window"))
    assert len(idx) == 50 - 20  # the 20-frame episode is too short for 21 frames
    assert [s.episode for s in idx.skipped] == [1]
    assert idx.window(7).start == 7


def test_windows_never_cross_a_task_change():
    tasks = ["a"] * 40 + ["b"] * 60
    segs = task_segments(0, tasks, 100)
    assert [(s.start, s.end) for s in segs] == [(0, 40), (40, 100)]
    idx = AnchorIndex(segs, WindowSpec(2, 10))
    for i in range(len(idx)):
        w = idx.window(i)
        assert len({tasks[f] for f in w.frames}) == 1


def test_too_short_dataset_is_a_clear_error_that_says_how_many_chunks_fit():
    with pytest.raises(DataError, match="long enough.*not even one chunk of 16 fits: lower the embodiment's"):
        AnchorIndex([Segment(0, 0, 10)], WindowSpec(4, 16))
    # 40 frames hold 2 chunks of 16 (33 frames), not 4 (65): the error names the --chunks that works
    with pytest.raises(DataError, match=r"the longest has 40 frames, so at most 2 chunks of 16 fit.*--chunks 2"):
        AnchorIndex([Segment(0, 0, 40), Segment(1, 0, 30)], WindowSpec(4, 16))
    assert len(AnchorIndex([Segment(0, 0, 40)], WindowSpec(2, 16))) == 40


def test_stream_is_a_permutation_per_epoch_and_deterministic():
    s = SampleStream([10], seed=3)
    first = [next(s)[1] for _ in range(10)]
    assert sorted(first) == list(range(10))
    second = [next(s)[1] for _ in range(10)]
    assert sorted(second) == list(range(10)) and second != first
    s2 = SampleStream([10], seed=3)
    assert [next(s2)[1] for _ in range(20)] == first + second


def test_stream_resumes_exactly_and_shards_disjointly():
    full = SampleStream([37], seed=1)
    ref = [next(full) for _ in range(30)]
    s = SampleStream([37], seed=1)
    for _ in range(11):
        next(s)
    state = s.state_dict()
    resumed = SampleStream([37], seed=1)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(19)] == ref[11:]
    ranks = [SampleStream([37], seed=1, rank=r, world_size=3) for r in range(3)]
    got = [[next(r)[2] for _ in range(12)] for r in ranks]  # global positions
    assert sorted(sum(got, [])) == list(range(36))
    with pytest.raises(DataError, match="world_size"):
        ranks[0].load_state_dict(dict(state, world_size=2))


def test_mixture_follows_the_weights():
    s = SampleStream([100, 10], weights=[3, 1], seed=0)
    ds = np.array([next(s)[0] for _ in range(4000)])
    assert abs((ds == 0).mean() - 0.75) < 0.03
    s = SampleStream([100, 10], weights=[0, 1], seed=0)
    assert {next(s)[0] for _ in range(100)} == {1}
    with pytest.raises(DataError, match="weights"):
        SampleStream([1, 2], weights=[1])
