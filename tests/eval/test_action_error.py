"""The held-out action error: the metric on hand-made cases, the held-out split the trainer honours, and the
promotion gate that uses it."""

from __future__ import annotations

import numpy as np
import pytest

from dzmodel.data.dataset import WindowDataset, heldout_split
from dzmodel.data.errors import DataError
from dzmodel.data.transforms import NormStats
from dzmodel.eval.action_error import describe, normalise_chunk, normalised_mse
from dzmodel.pipeline import promotion_decision


def test_a_perfect_predictor_scores_zero_and_the_mean_predictor_its_variance():
    rng = np.random.default_rng(0)
    targets = rng.uniform(-1, 1, size=(5, 16, 7))
    assert all(normalised_mse(t, t) == 0.0 for t in targets)
    # the mean predictor: a constant chunk; its error is the per-dim variance around that mean, averaged
    mean = targets.mean(axis=(0, 1))
    errors = [normalised_mse(np.broadcast_to(mean, t.shape), t) for t in targets]
    assert np.mean(errors) == pytest.approx(targets.reshape(-1, 7).var(axis=0).mean())
    # by hand: targets +1 and -1 in one dim, mean 0 -> error 1 there, 0 in a constant dim -> 0.5 overall
    hand = np.array([[[1.0, 0.3]], [[-1.0, 0.3]]])
    assert np.mean([normalised_mse(np.array([[0.0, 0.3]]), t) for t in hand]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="differ in shape"):
        normalised_mse(np.zeros((16, 7)), np.zeros((16, 6)))


def test_chunks_are_compared_in_the_q99_normalised_space():
    stats = NormStats(q01=np.array([0.0, -2.0]), q99=np.array([10.0, 2.0]))
    chunk = np.array([[0.0, -2.0], [5.0, 0.0], [10.0, 2.0]])
    assert np.allclose(normalise_chunk(chunk, np.zeros(2), stats, []), [[-1, -1], [0, 0], [1, 1]])
    # a relative key (action 0 relative to state 1) is made relative to the anchor state first
    rel = normalise_chunk(chunk + 3.0 * np.array([1.0, 0.0]), np.array([0.0, 3.0]), stats, [(slice(0, 1), slice(1, 2))])
    assert np.allclose(rel, [[-1, -1], [0, 0], [1, 1]])


def test_heldout_split_is_the_last_episodes_and_leaves_some_to_train_on():
    assert heldout_split([3, 0, 2, 1], 1) == ([0, 1, 2], [3])
    assert heldout_split(range(8), 2) == (list(range(6)), [6, 7])
    with pytest.raises(DataError, match=r"train.heldout_episodes: 4 held-out episodes must leave at least one"):
        heldout_split(range(4), 4)


def test_training_never_samples_the_heldout_episodes(tmp_path):
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.data.lerobot_format import open_dataset
    from dzmodel.data.sampling import WindowSpec
    from dzmodel.data.synth import make_synthetic_dataset
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.windows import training_windows

    ds = make_synthetic_dataset(tmp_path / "ds", num_episodes=4, episode_length=40, codec="libx264", motion="orbit")
    emb = get_embodiment("libero_sim_tiny")
    spec = WindowSpec(2, 16, 4)
    full = WindowDataset(open_dataset(ds), emb, spec, None, train=False)
    held = training_windows(ds, emb, spec, None, TrainConfig(heldout_episodes=1), train=False)
    assert {full.index.window(i).episode for i in range(len(full))} == {0, 1, 2, 3}
    assert {held.index.window(i).episode for i in range(len(held))} == {0, 1, 2}
    with pytest.raises(ValueError, match="heldout_episodes: must be >= 0"):
        TrainConfig(heldout_episodes=-1)


def test_orbit_actions_are_predictable_from_the_state_the_walk_is_not():
    """What makes the demo learnable: a linear map from the anchor state to the next 16 actions beats the mean
    predictor by far on orbits, and barely on random walks."""
    from dzmodel.data.synth import _episode_trajectory, _orbit_trajectory, _state_from_traj

    def ratio(make):
        rng = np.random.default_rng(0)
        eps = [make(rng, 64, 64) for _ in range(12)]
        acts = np.concatenate([e["actions"] for e in eps])
        stats = NormStats(np.quantile(acts, 0.01, axis=0), np.quantile(acts, 0.99, axis=0))
        xs, ys = [], []
        for e in eps:
            s, a = _state_from_traj(e, 64), stats.normalize(e["actions"])
            xs += [np.append(s[t], 1.0) for t in range(0, 48)]
            ys += [a[t:t + 16].ravel() for t in range(0, 48)]
        x, y = np.array(xs), np.array(ys)
        cut = 10 * 48  # the last two episodes held out
        w = np.linalg.lstsq(x[:cut], y[:cut], rcond=None)[0]
        mean = y[:cut].reshape(-1, 16, 7).mean(axis=(0, 1))
        held = y[cut:].reshape(-1, 16, 7)
        return (((x[cut:] @ w).reshape(-1, 16, 7) - held) ** 2).mean() / ((held - mean) ** 2).mean()

    assert ratio(_orbit_trajectory) < 0.2
    assert ratio(_episode_trajectory) > 0.8


def test_the_gate_checks_the_action_error_and_success_where_set():
    ok, why = promotion_decision(0.0, None, 0.3, 0.5)
    assert ok and why == "passed: held-out action error ratio 0.30 (vs the mean predictor) <= gate 0.50"
    ok, why = promotion_decision(None, None, 0.8, 0.5)
    assert not ok and why == "refused: held-out action error ratio 0.80 (vs the mean predictor) > gate 0.50"
    ok, why = promotion_decision(0.9, 0.8, None, 0.5)
    assert not ok and "no held-out action error" in why
    ok, why = promotion_decision(0.2, 0.8, 0.3, 0.5)  # both set: each must pass
    assert not ok and why.endswith("LIBERO success 20.0% < gate 80.0%")
    ok, why = promotion_decision(0.9, 0.8, 0.3, 0.5)
    assert ok and "ratio 0.30" in why and "90.0% >= gate 80.0%" in why
    ok, why = promotion_decision(1.0, None, None, None)
    assert not ok and "no gate is set" in why


def test_describe_is_one_line():
    result = {"last": {"step": 30, "trained": 0.1234, "ratio": 0.3}, "mean_predictor": 0.41, "untrained": 1.3}
    assert describe(result) == "held-out action error 0.12 (mean predictor 0.41, untrained 1.3), ratio 0.3 at step 30"
