"""A converted checkpoint as a robot policy: loads with the run's encoders, tokenizer and embodiment."""

import numpy as np
import pytest
import torch

from dzmodel.policy.policy import PolicyLoadError, load_policy
from dzmodel.model.sampler import SolverConfig
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, resolve_checkpoint
from dzmodel.train.encoders import frozen_encoders
from dzmodel.train.trainer import train
from tests.tiny_data import make_tabletop_data

@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = make_tabletop_data(tmp_path_factory.mktemp("policy"), num_episodes=2, episode_length=30)
    cfg = TrainConfig(preset="tiny", datasets=[str(root / "ds")], embodiment="tabletop_pusher", seed=5,
                      embodiment_files=[str(root / "emb.yaml")], metadata=str(root / "meta.json"),
                      steps=2, save_every=2, out_dir=str(root / "run"), lr=1e-3, progress=False)
    train(cfg)
    hf = convert_checkpoint(resolve_checkpoint(root / "run"), root / "hf")
    (root / "emb.yaml").unlink()  # the converted directory must not need the original files
    return hf, cfg


def test_policy_predicts_chunks_in_robot_units_with_the_runs_encoders(converted):
    hf, cfg = converted
    pol = load_policy(hf, solver=SolverConfig(num_steps=2, cfg_scale=1.0), seed=1)
    assert pol.step == 2 and pol.action_horizon == 4 and pol.embodiment.tag == "tabletop_pusher"
    trained = frozen_encoders(cfg)
    for a, b in zip(trained.modules(), (pol.policy.vae, pol.policy.text_encoder, pol.policy.image_encoder)):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    rng = np.random.default_rng(0)
    views = {"front": rng.integers(0, 255, (48, 48, 3), dtype=np.uint8),
             "hand": rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)}
    state = np.zeros(pol.policy.state_stats.q01.shape[0])
    assert pol.frame(views).shape == (1, 32, 64, 3)
    a1 = pol.predict("s1", views, state, "Push the block.")
    assert a1.shape == (4, pol.action_dim) and np.isfinite(a1).all()
    lo, hi = pol.policy.action_stats.q01, pol.policy.action_stats.q99
    assert (a1 >= lo - 1e-9).all() and (a1 <= hi + 1e-9).all()  # un-normalised into the data's range
    assert "s1" in pol.policy.sessions
    pol.end_session("s1")
    assert "s1" not in pol.policy.sessions
    np.testing.assert_array_equal(pol.predict("s1", views, state, "Push the block."), a1)  # a fresh session repeats
    with pytest.raises(ValueError, match="needs views"):
        pol.predict("s2", {"front": views["front"]}, state, "x")


def test_policy_refuses_a_wrong_embodiment_or_a_raw_run_directory(converted, tmp_path):
    hf, cfg = converted
    with pytest.raises(PolicyLoadError, match="trained for embodiment 'tabletop_pusher', not 'libero_sim'"):
        load_policy(hf, embodiment="libero_sim")
    with pytest.raises(PolicyLoadError, match="dz convert"):
        load_policy(cfg.out_dir)


def test_offline_encoders_are_drawn_on_the_cpu_whatever_the_device(monkeypatch):
    """A small-preset run trained on a GPU and evaluated on a CPU must see the same random encoders: CUDA's
    generator would draw other numbers, so the offline presets draw on the CPU and move."""
    import dzmodel.train.encoders as E

    built_on = []
    real = E.build_encoders
    monkeypatch.setattr(E, "build_encoders", lambda preset, device: built_on.append(str(device)) or real(preset, device))
    cpu = frozen_encoders(TrainConfig(preset="small", seed=3))
    moved = frozen_encoders(TrainConfig(preset="small", seed=3), device="meta")  # stands in for "cuda"
    assert built_on == ["cpu", "cpu"]
    assert all(p.is_meta for m in moved.modules() for p in m.parameters())
    assert cpu.spec.image_size == (128, 256)


def test_a_dataset_sample_and_the_same_observation_sent_to_the_policy_give_identical_pixels_and_state(converted):
    """Training and serving share their IO rules (dzmodel/data/transforms.py): the raw camera frames and state of
    one recorded step, sent to the policy as a robot would, become exactly the pixels and normalised state that
    training's sample of that step holds."""
    from dzmodel.data.dataset import load_statistics
    from dzmodel.data.sampling import WindowSpec
    from dzmodel.model.args import preset
    from dzmodel.train.windows import training_windows

    hf, cfg = converted
    pol = load_policy(hf, solver=SolverConfig(num_steps=2, cfg_scale=1.0), seed=1)
    emb = pol.embodiment
    args = preset(cfg.preset, **cfg.model_overrides)
    spec = WindowSpec(args.max_chunk_size, emb.action_horizon, 4 * args.num_frame_per_block, emb.sampling)
    ds = training_windows(cfg.datasets[0], emb, spec, load_statistics(cfg.metadata, emb.tag), cfg, train=False)
    checked = 0
    for anchor in (0, len(ds) // 2, len(ds) - 1):
        sample = ds.sample(anchor)
        w = ds.index.window(anchor)
        frame = int(w.frames[0])
        views = {short: ds.reader.read_frames(w.episode, key, [frame])[0] for short, key in emb.views.items()}
        columns = sorted({k.column for k in emb.state})
        raw_state = ds._vectors(ds.reader.read_columns(w.episode, columns), emb.state, w.state_rows[:1], w.episode)[0]
        pixels = pol.frame(views)
        assert pixels.dtype == np.uint8 and sample["images"].dtype == torch.uint8
        np.testing.assert_array_equal(pixels[0], sample["images"][0].numpy())
        _, _, _, state = pol.policy._parse({"images": pixels, "state": raw_state, "prompt": "x"})
        width = sample["state"].shape[1]
        np.testing.assert_array_equal(state[0, 0, :width].cpu().numpy(), sample["state"][0].numpy())
        checked += 1
    assert checked == 3


def test_a_project_relative_dataset_is_found_from_another_directory(tmp_path, monkeypatch):
    """A DVC or Prefect stage records its dataset relative to the project; evaluating the model from elsewhere
    finds the project's dataset, from the folders above the model, before one in the working directory."""
    import json

    from dzmodel.policy.policy import read_train_config

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    for folder in ("data/demo", "data/both"):
        (project / folder).mkdir(parents=True)
    for folder in ("data/local", "data/both"):
        (elsewhere / folder).mkdir(parents=True)
    model = project / "runs" / "demo" / "hf"
    (model / "experiment_cfg").mkdir(parents=True)
    raw = TrainConfig(datasets=["data/demo", "data/both", "data/local", "data/gone", "s3://bucket/ds"]).to_dict()
    (model / "experiment_cfg" / "train_config.json").write_text(json.dumps({**raw, "step": 3}))
    monkeypatch.chdir(elsewhere)
    cfg, step = read_train_config(model)
    assert step == 3
    # above the model (first, also where the working directory has one too); else as given: from the working
    # directory, or for the error to name
    assert cfg.datasets == [str(project / "data" / "demo"), str(project / "data" / "both"), "data/local", "data/gone",
                            "s3://bucket/ds"]  # a URI as it was
