"""`dz data record libero`'s starts, DART noise, DAgger and privileged object column in the real simulator
(1 task of LIBERO-Object, 64 px, a few dozen steps per episode). Slow: several minutes on 2 shared CPU cores, so
`make test` skips it (`make test-slow` runs it). The bookkeeping of the same options against a scripted pool is
in test_libero_record.py."""

import json

import numpy as np
import pytest

pytest.importorskip("libero")
pytestmark = pytest.mark.slow

STEPS = 30


def _record(out, **kw):
    from dzmodel.eval.libero_record import RecordConfig, record_libero

    base = dict(suite="object", tasks=[0], episodes=2, image_size=64, workers=2, codec="libx264", keep="all",
                max_steps=STEPS)
    return record_libero(RecordConfig(**{**base, **kw}), out, progress=False, log=lambda s: None)


def _columns(out, keys):
    from dzmodel.data.lerobot_format import open_dataset

    reader = open_dataset(out)
    return [{k: np.asarray(v) for k, v in reader.read_columns(e.index, keys).items()} for e in reader.episodes]


def _standard_states(task=0):
    from dzmodel.eval.libero_env import init_state, list_tasks

    t = list_tasks("object")[task]
    return np.stack([init_state(t, k) for k in range(t.num_init_states)])


def _check_far_from_every_standard_start(summary, min_shift):
    from dzmodel.eval.libero_expert import init_state_distance

    index = np.asarray(summary["per_task"][0]["object_xy_index"])
    standard = _standard_states()
    assert len(index) == 7  # LIBERO-Object's movable objects (basket included)
    for e in summary["episodes"]:
        d = init_state_distance(index, np.asarray(e["init_state"]), standard)
        assert d.shape == (50,) and d.min() >= min_shift - 1e-12, (e["attempt"], d.min())
        assert e["init"]["min_distance_to_standard"] == pytest.approx(d.min())
    return index, standard


@pytest.fixture(scope="module")
def perturbed(tmp_path_factory):
    out = tmp_path_factory.mktemp("rec") / "perturbed"
    return out, _record(out, init="perturbed", max_shift_m=0.03, min_shift_m=0.015)


def test_perturbed_starts_move_every_object_and_are_no_evaluation_start(perturbed):
    out, summary = perturbed
    index, standard = _check_far_from_every_standard_start(summary, 0.015)
    for e in summary["episodes"]:
        base = standard[e["init"]["base_index"]]
        shift = np.asarray(e["init_state"])[np.stack([index, index + 1], -1)] - base[np.stack([index, index + 1], -1)]
        np.testing.assert_allclose(shift, e["init"]["object_shift_xy"])
        assert np.all(np.linalg.norm(shift, axis=-1) >= 0.015) and np.all(np.abs(shift) <= 0.03)
        # the rest of the state is the standard one
        rest = np.ones(len(base), bool)
        rest[np.concatenate([index, index + 1])] = False
        np.testing.assert_array_equal(np.asarray(e["init_state"])[rest], base[rest])


def test_objects_column_follows_the_goal_object(perturbed):
    out, summary = perturbed
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["features"]["observation.objects"]["shape"] == [6] and "executed_action" not in info["features"]
    for cols in _columns(out, ["observation.objects", "observation.state"]):
        obj, eef = cols["observation.objects"][:, :3], cols["observation.state"][:, :3]
        assert np.all(np.isfinite(cols["observation.objects"]))
        assert 0.0 < obj[0, 2] < 0.2 and np.ptp(cols["observation.objects"][:, 3:], axis=0).max() < 1e-3  # basket still
        # the expert moves the hand towards the object: the distance shrinks over the first 30 steps
        assert np.linalg.norm(eef[-1, :2] - obj[-1, :2]) < np.linalg.norm(eef[0, :2] - obj[0, :2])


def test_dart_executes_noise_records_the_clean_action_and_changes_the_trajectory(perturbed, tmp_path):
    out, clean = perturbed
    noisy = _record(tmp_path / "dart", init="perturbed", max_shift_m=0.03, min_shift_m=0.015, dart_noise=0.2)
    assert [e["init_state"] for e in noisy["episodes"]] == [e["init_state"] for e in clean["episodes"]]  # same starts
    info = json.loads((tmp_path / "dart" / "meta" / "info.json").read_text())
    assert info["dz_recording"]["dart_noise"] == 0.2 and noisy["per_task"][0]["attempts"] == 2
    for c, n in zip(_columns(out, ["observation.state", "action"]),
                    _columns(tmp_path / "dart", ["observation.state", "action", "executed_action"])):
        label, executed = n["action"], n["executed_action"]
        noise = executed[:, :6] - label[:, :6]
        assert 0.12 < noise.std() < 0.25 and abs(noise.mean()) < 0.05  # σ 0.2, a little clipped at ±1
        assert np.all(np.abs(executed) <= 1) and np.array_equal(executed[:, 6], label[:, 6])
        assert label[:, 0].min() >= -0.4 - 1e-6 and set(np.unique(label[:, 6])) <= {-1.0, 1.0}  # the expert's law
        assert np.abs(label[:, 3:6]).max() > 0  # it turns the noised hand back (hold_orientation)
        assert np.abs(n["observation.state"][5:] - c["observation.state"][5:len(n["observation.state"])]).max() > 0.005


def test_sampled_starts_come_from_the_init_distribution_away_from_every_standard_start(tmp_path):
    summary = _record(tmp_path / "sampled", init="sampled", max_steps=3)
    _check_far_from_every_standard_start(summary, 0.002)  # the default: LIBERO-Object's init regions are small
    a, b = (np.asarray(e["init_state"]) for e in summary["episodes"])
    assert summary["episodes"][0]["init"]["base_index"] is None and not np.array_equal(a, b)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from dzmodel.data.dataset import embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.data.synth import make_synthetic_dataset
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
    from dzmodel.train.trainer import train

    root = tmp_path_factory.mktemp("tiny")
    ds = make_synthetic_dataset(root / "ds", num_episodes=2, episode_length=40)
    embodiment_metadata(ds, get_embodiment("libero_sim_tiny"), root / "meta.json")
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(ds)],
                      embodiment="libero_sim_tiny", metadata=str(root / "meta.json"), steps=1, save_every=1,
                      out_dir=str(root / "run"), lr=1e-3, progress=False))
    return convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")


def test_dagger_executes_the_policy_and_labels_with_the_expert(tiny_model, tmp_path):
    from dzmodel.eval.libero_env import env_action
    from dzmodel.eval.libero_record import RecordConfig, record_libero
    from dzmodel.policy.policy import load_policy
    from dzmodel.model.sampler import SolverConfig

    policy = load_policy(tiny_model, solver=SolverConfig(num_steps=2, cfg_scale=1.0))
    served = {}
    predict = policy.predict_batch

    def logged(requests):
        chunks = predict(requests)
        for (sid, *_), chunk in zip(requests, chunks):
            served.setdefault(sid, []).extend(env_action(a) for a in chunk[:4])
        return chunks

    policy.predict_batch = logged
    cfg = RecordConfig(suite="object", tasks=[0], episodes=1, image_size=64, workers=1, codec="libx264",
                       max_steps=12, init="perturbed", dagger=str(tiny_model), dagger_beta=0.0, actions_per_chunk=4)
    summary = record_libero(cfg, tmp_path / "dagger", progress=False, log=lambda s: None, policy=policy)
    e = summary["episodes"][0]
    assert summary["kept"] == 1 and e["steps"] == 12 and e["policy_steps"] == 12 and e["chunk_actors"] == "PPP"
    cols = _columns(tmp_path / "dagger", ["action", "executed_action"])[0]
    (sid,) = served
    np.testing.assert_allclose(cols["executed_action"], np.stack(served[sid])[:12].astype(np.float32), rtol=1e-6)
    label = cols["action"]
    assert not np.allclose(label, cols["executed_action"])  # the labels are not what was executed...
    assert label[:, 0].min() >= -0.4 - 1e-6 and set(np.unique(label[:, 6])) <= {-1.0, 1.0}  # ...but the expert's
    assert label[0, 6] == -1.0 and np.abs(label[:, :3]).max() > 0.5  # approaching, gripper open
