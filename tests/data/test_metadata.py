"""metadata.json: streamed statistics equal numpy; quantile bound; sub-keys; relative actions; merge; errors."""

import json
from pathlib import Path

import numpy as np
import pytest

from dzmodel.data.errors import DataError
from dzmodel.data.metadata import KeySpec, compute_metadata

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

STATS = ("min", "max", "mean", "std", "q01", "q99")


def make_dataset(root: Path, lengths, state_dim=8, action_dim=7, seed=0, files=1, nan_at=None, dist="normal",
                 extreme_episodes=()):
    """A minimal v3.0-like dataset: meta/info.json + data parquet file(s) with fixed-size-list columns.
    extreme_episodes: episodes whose state and actions are scaled by 100."""
    rng = np.random.default_rng(seed)
    n = int(sum(lengths))
    if dist == "normal":
        state = rng.normal(size=(n, state_dim)) * np.arange(1, state_dim + 1) + np.arange(state_dim)
        action = rng.normal(size=(n, action_dim))
    else:  # skewed, heavy tail
        state = rng.exponential(size=(n, state_dim)) ** 2
        action = rng.lognormal(size=(n, action_dim))
    state, action = state.astype(np.float32), action.astype(np.float32)
    if nan_at is not None:
        state[nan_at, 2] = np.nan
    ep = np.repeat(np.arange(len(lengths)), lengths)
    extreme = np.isin(ep, list(extreme_episodes))
    state[extreme] *= 100
    action[extreme] *= 100
    fi = np.concatenate([np.arange(L) for L in lengths])
    features = {
        "observation.images.front": {"dtype": "video", "shape": [48, 80, 3], "names": ["height", "width", "channels"],
                                     "info": {"video.fps": 15}},
        "observation.state": {"dtype": "float32", "shape": [state_dim], "names": None},
        "action": {"dtype": "float32", "shape": [action_dim], "names": None},
        "episode_index": {"dtype": "int64", "shape": [1], "names": None},
        "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    }
    (root / "meta").mkdir(parents=True)
    (root / "meta/info.json").write_text(json.dumps({"codebase_version": "v3.0", "fps": 15, "features": features}))
    # split episodes over `files` files, row groups of 5 rows
    ep_bounds = np.cumsum([0, *lengths])
    per_file = np.array_split(np.arange(len(lengths)), files)
    paths = []
    for f, eps in enumerate(per_file):
        lo, hi = ep_bounds[eps[0]], ep_bounds[eps[-1] + 1]
        t = pa.table({
            "observation.state": pa.FixedSizeListArray.from_arrays(pa.array(state[lo:hi].ravel()), state_dim),
            "action": pa.FixedSizeListArray.from_arrays(pa.array(action[lo:hi].ravel()), action_dim),
            "episode_index": pa.array(ep[lo:hi]),
            "frame_index": pa.array(fi[lo:hi]),
        })
        p = root / f"data/chunk-000/file-{f:03d}.parquet"
        p.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(t, p, row_group_size=5)
        paths.append(p)
    return state.astype(np.float64), action.astype(np.float64), ep, paths


def np_stats(x):
    return {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0),
            "q01": np.quantile(x, 0.01, axis=0), "q99": np.quantile(x, 0.99, axis=0)}


def assert_stats_equal(got, want, rtol=1e-9, atol=1e-9):
    assert set(got) == set(STATS)
    for k in STATS:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=k)


def test_exact_stats_match_numpy(tmp_path):
    lengths = [7, 12, 3, 20, 9]
    state, action, _, _ = make_dataset(tmp_path / "ds", lengths, files=2)
    doc = compute_metadata(tmp_path / "ds", "tag", {"state": "observation.state"}, {"action": "action"},
                           tmp_path / "out/metadata.json", batch_rows=4)
    e = doc["tag"]
    assert e["embodiment_tag"] == "tag"
    assert_stats_equal(e["statistics"]["state"]["state"], np_stats(state))
    assert_stats_equal(e["statistics"]["action"]["action"], np_stats(action))
    assert "relative_action" not in e["statistics"]
    assert e["modalities"]["video"] == {"front": {"resolution": [48, 80], "channels": 3, "fps": 15.0}}
    assert e["modalities"]["state"]["state"] == {"absolute": True, "rotation_type": None, "shape": [8], "continuous": True}
    assert e["modalities"]["action"]["action"]["shape"] == [7]
    assert json.loads((tmp_path / "out/metadata.json").read_text()) == doc
    for s in e["statistics"]["state"]["state"].values():
        assert all(isinstance(v, float) for v in s)


def test_histogram_quantiles_within_bound(tmp_path):
    lengths = [500] * 12
    for dist in ("normal", "skewed"):
        root = tmp_path / dist
        state, action, _, _ = make_dataset(root, lengths, dist=dist)
        bins = 64
        doc = compute_metadata(root, "t", {"s": "observation.state"}, {"a": "action"},
                               exact_threshold=1000, quantile_bins=bins, batch_rows=777)
        for group, key, x in (("state", "s", state), ("action", "a", action)):
            got = doc["t"]["statistics"][group][key]
            want = np_stats(x)
            for k in ("min", "max", "mean", "std"):  # moments stay exact
                np.testing.assert_allclose(got[k], want[k], rtol=1e-9, atol=1e-9)
            bound = (x.max(0) - x.min(0)) / bins
            for k in ("q01", "q99"):
                err = np.abs(np.array(got[k]) - want[k])
                assert (err <= bound * (1 + 1e-9)).all(), (dist, key, k, err / bound)
            assert not np.allclose(got["q99"], want["q99"], rtol=0, atol=1e-12)  # really the histogram path


def test_sliced_sub_keys(tmp_path):
    state, action, _, _ = make_dataset(tmp_path / "ds", [10, 15])
    doc = compute_metadata(
        tmp_path / "ds", "droid",
        state_keys={"joint_position": "observation.state[0:5]", "gripper": ("observation.state", slice(5, 6)),
                    "rest": KeySpec("observation.state", 6, None), "last": "observation.state[-1:]"},
        action_keys={"xyz": "action[:3]", "all": ("action", None)},
    )
    st = doc["droid"]["statistics"]
    assert_stats_equal(st["state"]["joint_position"], np_stats(state[:, 0:5]))
    assert_stats_equal(st["state"]["gripper"], np_stats(state[:, 5:6]))
    assert_stats_equal(st["state"]["rest"], np_stats(state[:, 6:]))
    assert_stats_equal(st["state"]["last"], np_stats(state[:, 7:]))
    assert_stats_equal(st["action"]["xyz"], np_stats(action[:, :3]))
    mods = doc["droid"]["modalities"]
    assert [mods["state"][k]["shape"] for k in ("joint_position", "gripper", "rest", "last")] == [[5], [1], [2], [1]]
    assert mods["action"]["all"]["shape"] == [7]


def test_a_slice_past_the_declared_width_names_the_key_and_the_shape(tmp_path):
    """info.json declares fewer dims than the data holds: the slice is checked against the declaration."""
    make_dataset(tmp_path / "ds", [10])
    info_file = tmp_path / "ds" / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    info["features"]["observation.state"]["shape"] = [4]
    info_file.write_text(json.dumps(info))
    with pytest.raises(DataError, match=r"key 'joints': slice \[0:6\] exceeds column 'observation.state' shape \[4\]"):
        compute_metadata(tmp_path / "ds", "droid", state_keys={"joints": "observation.state[0:6]"},
                         action_keys={"all": "action"})


def test_relative_action_stats_brute_force(tmp_path):
    lengths = [5, 17, 3, 11, 1]
    H = 4
    state, action, ep, _ = make_dataset(tmp_path / "ds", lengths, state_dim=6, action_dim=6, files=2)
    doc = compute_metadata(tmp_path / "ds", "t", {"eef": "observation.state[0:3]", "grip": "observation.state[3:6]"},
                           {"eef": "action[0:3]", "grip": "action[3:6]"}, relative_action_keys=["eef"],
                           action_horizon=H, batch_rows=4)
    rel = []
    starts = np.cumsum([0, *lengths])
    for e, L in enumerate(lengths):
        s0 = starts[e]
        for a in range(L):
            for k in range(H):
                if a + k < L:
                    rel.append(action[s0 + a + k, 0:3] - state[s0 + a, 0:3])
    rel = np.array(rel)
    got = doc["t"]["statistics"]["relative_action"]
    assert set(got) == {"eef"}
    assert_stats_equal(got["eef"], np_stats(rel))
    # absolute action stats unaffected
    assert_stats_equal(doc["t"]["statistics"]["action"]["eef"], np_stats(action[:, 0:3]))
    # histogram path for relative stats also within bound
    doc2 = compute_metadata(tmp_path / "ds", "t", {"eef": "observation.state[0:3]"}, {"eef": "action[0:3]"},
                            relative_action_keys=["eef"], action_horizon=H, exact_threshold=10, quantile_bins=50)
    g2 = doc2["t"]["statistics"]["relative_action"]["eef"]
    bound = (rel.max(0) - rel.min(0)) / 50
    for k in ("q01", "q99"):
        assert (np.abs(np.array(g2[k]) - np_stats(rel)[k]) <= bound * (1 + 1e-9)).all()


def test_relative_key_must_exist_in_both(tmp_path):
    make_dataset(tmp_path / "ds", [4])
    with pytest.raises(DataError, match="'grip'"):
        compute_metadata(tmp_path / "ds", "t", {"eef": "observation.state[0:3]"}, {"eef": "action[0:3]"},
                         relative_action_keys=["grip"])
    with pytest.raises(DataError, match="'eef'.*width"):
        compute_metadata(tmp_path / "ds", "t", {"eef": "observation.state[0:4]"}, {"eef": "action[0:3]"},
                         relative_action_keys=["eef"])


def test_merge_keeps_other_tags(tmp_path):
    make_dataset(tmp_path / "ds", [6, 6])
    out = tmp_path / "meta.json"
    compute_metadata(tmp_path / "ds", "a", {"s": "observation.state"}, {"x": "action"}, out)
    compute_metadata(tmp_path / "ds", "b", {"s": "observation.state[0:2]"}, {"x": "action"}, out, merge=True)
    doc = json.loads(out.read_text())
    assert set(doc) == {"a", "b"}
    assert doc["b"]["modalities"]["state"]["s"]["shape"] == [2]
    # same tag replaced
    compute_metadata(tmp_path / "ds", "a", {"s": "observation.state[0:3]"}, {"x": "action"}, out, merge=True)
    doc = json.loads(out.read_text())
    assert set(doc) == {"a", "b"} and doc["a"]["modalities"]["state"]["s"]["shape"] == [3]
    # without merge the file holds only the new tag
    compute_metadata(tmp_path / "ds", "c", {"s": "observation.state"}, {"x": "action"}, out)
    assert set(json.loads(out.read_text())) == {"c"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left


def test_max_episodes(tmp_path):
    lengths = [4, 6, 8]
    state, _, _, _ = make_dataset(tmp_path / "ds", lengths)
    doc = compute_metadata(tmp_path / "ds", "t", {"s": "observation.state"}, {"a": "action"}, max_episodes=2,
                           batch_rows=3)
    assert_stats_equal(doc["t"]["statistics"]["state"]["s"], np_stats(state[:10]))


def test_heldout_episodes_are_left_out_of_the_statistics(tmp_path):
    """train.heldout_episodes N: the last N episodes (here with extreme values) shape no statistic, relative
    actions included, and the entry records where the statistics came from."""
    from dzmodel.data.dataset import heldout_split

    lengths = [6, 8, 7, 5, 9]
    state, action, ep, _ = make_dataset(tmp_path / "ds", lengths, state_dim=7, files=2, extreme_episodes=(3, 4))
    keys = dict(state_keys={"x": "observation.state"}, action_keys={"x": "action"}, relative_action_keys=["x"],
                action_horizon=2, batch_rows=4)
    held = compute_metadata(tmp_path / "ds", "t", out_path=tmp_path / "meta.json", heldout_episodes=2, **keys)["t"]
    every = compute_metadata(tmp_path / "ds", "t", **keys)["t"]
    train_eps, held_eps = heldout_split(range(len(lengths)), 2)  # the trainer's split
    assert held_eps == [3, 4]
    rows = np.isin(ep, train_eps)
    assert_stats_equal(held["statistics"]["state"]["x"], np_stats(state[rows]))
    assert_stats_equal(held["statistics"]["action"]["x"], np_stats(action[rows]))
    for group in ("state", "action", "relative_action"):
        assert max(every["statistics"][group]["x"]["q99"]) > 10 * max(held["statistics"][group]["x"]["q99"]), group
    assert (held["statistics_episodes"], held["heldout_episodes"]) == (3, [3, 4])
    assert (every["statistics_episodes"], every["heldout_episodes"]) == (5, [])
    assert json.loads((tmp_path / "meta.json").read_text())["t"]["statistics_episodes"] == 3
    first = compute_metadata(tmp_path / "ds", "t", heldout_episodes=2, max_episodes=2, **keys)["t"]  # a quick look
    assert first["statistics_episodes"] == 2
    assert_stats_equal(first["statistics"]["action"]["x"], np_stats(action[ep < 2]))
    with pytest.raises(DataError, match="train.heldout_episodes: 5 held-out episodes must leave at least one"):
        compute_metadata(tmp_path / "ds", "t", heldout_episodes=5, **keys)
    with pytest.raises(DataError, match="heldout_episodes: must be >= 0, got -1"):
        compute_metadata(tmp_path / "ds", "t", heldout_episodes=-1, **keys)


def test_refuses_out_path_inside_dataset(tmp_path):
    make_dataset(tmp_path / "ds", [4])
    for bad in (tmp_path / "ds/meta/metadata.json", tmp_path / "ds/metadata.json", tmp_path / "ds/../ds/x.json"):
        with pytest.raises(DataError, match="inside the dataset"):
            compute_metadata(tmp_path / "ds", "t", {"s": "observation.state"}, {"a": "action"}, bad)
    assert not (tmp_path / "ds/meta/metadata.json").exists() and not (tmp_path / "ds/metadata.json").exists()


def test_nan_names_file_episode_column_frame(tmp_path):
    _, _, _, paths = make_dataset(tmp_path / "ds", [5, 9], nan_at=11)  # row 11: episode 1, frame 6
    with pytest.raises(DataError) as ei:
        compute_metadata(tmp_path / "ds", "t", {"s": "observation.state"}, {"a": "action"}, batch_rows=4)
    msg = str(ei.value)
    assert str(paths[0]) in msg and "episode 1, column 'observation.state': nan at frame 6 (dim 2)" in msg


def test_bad_dims_name_the_key(tmp_path):
    make_dataset(tmp_path / "ds", [5])
    with pytest.raises(DataError, match="key 'joints'.*width 8"):
        compute_metadata(tmp_path / "ds", "t", {"joints": "observation.state[4:12]"}, {"a": "action"})
    with pytest.raises(DataError, match="key 'empty'"):
        compute_metadata(tmp_path / "ds", "t", {"empty": "observation.state[3:3]"}, {"a": "action"})
    with pytest.raises(DataError, match="'nope'.*not found"):
        compute_metadata(tmp_path / "ds", "t", {"s": "nope"}, {"a": "action"})


def test_on_synthetic_dataset(tmp_path):
    pytest.importorskip("av")
    from dzmodel.data.synth import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path / "synth", num_episodes=2, episode_length=20, image_size=32, codec="libx264")
    doc = compute_metadata(root, "libero_sim", {"eef": "observation.state[0:3]", "gripper": "observation.state[6:8]"},
                           {"eef": "action[0:3]", "gripper": "action[6:7]"}, tmp_path / "metadata.json",
                           relative_action_keys=["eef"], action_horizon=8)
    e = doc["libero_sim"]
    assert e["modalities"]["video"] == {"image": {"resolution": [32, 32], "channels": 3, "fps": 10.0},
                                        "wrist_image": {"resolution": [32, 32], "channels": 3, "fps": 10.0}}
    assert e["statistics"]["action"]["gripper"]["min"] == [-1.0] and e["statistics"]["action"]["gripper"]["max"] == [1.0]
    assert set(e["statistics"]["relative_action"]) == {"eef"}


def test_a_wrong_declared_dim_is_refused_and_nothing_is_written(tmp_path):
    """The embodiment says the state has 3 dims; the synthetic dataset's state has 8: one error naming the key,
    the data's width and the declared dim, and no metadata.json."""
    from dzmodel.data.dataset import embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment, load_embodiments
    from dzmodel.data.errors import DataError
    from dzmodel.data.synth import make_synthetic_dataset
    from tests.tiny_data import TABLETOP_EMBODIMENT

    ds = make_synthetic_dataset(tmp_path / "ds", num_episodes=1, episode_length=20, image_size=32, codec="libx264")
    (tmp_path / "emb.yaml").write_text(TABLETOP_EMBODIMENT.replace("{column: observation.state}",
                                                                   "{column: observation.state, dim: 3}"))
    emb = get_embodiment("tabletop_pusher", load_embodiments([tmp_path / "emb.yaml"]))
    with pytest.raises(DataError, match=r"state key 'state': the data has 8 dims .* declares dim 3"):
        embodiment_metadata(ds, emb, tmp_path / "meta.json")
    assert not (tmp_path / "meta.json").exists()
