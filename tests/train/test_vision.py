"""Vision pretraining (dzmodel/train/vision.py and the pipeline's vision stage) on the tiny preset, on CPU: the
trained VAE reconstructs held-out frames far better than the seeded random one, loads unchanged as
train.encoder_weights.vae, and gives the DiT unit-scale latents."""

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dzmodel.config import ParamsError, StagePaths, load_params, parse_params, read_yaml, train_config
from dzmodel.train.config import TrainConfig
from dzmodel.train.encoders import frozen_encoders
from dzmodel.train.vision import (VisionError, fold_latent_normalisation, latent_statistics, load_clips,
                                  pretrain_vae, random_items, reconstruction_mse, spread_items, vision_windows)
from tests.tiny_data import LIBERO32_EMBODIMENT, make_libero32_data

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_libero32_data(tmp_path_factory.mktemp("vision"))


def _cfg(data, **kw) -> TrainConfig:
    return TrainConfig(**{"preset": "tiny", "datasets": [str(data / "ds")], "metadata": str(data / "meta.json"),
                          "embodiment": "libero_sim_32", "embodiment_files": [str(data / "emb.yaml")], **kw})


@pytest.fixture(scope="module")
def pretrained(data):
    out = data / "vision"
    report = pretrain_vae(_cfg(data), out, steps=8, batch_size=2, lr=3e-3, clip_frames=5, heldout_episodes=1,
                          device="cpu", frame_cache_mib=64, eval_clips=6, norm_clips=8, progress=False,
                          log=lambda line: None)
    return out, report


def test_the_pretrained_tiny_vae_reconstructs_heldout_frames_better_than_the_random_one(pretrained):
    out, report = pretrained
    # measured: 0.07 against 0.37 after 8 steps of 2 five-frame clips (about 5 s on one core); left random, 0.37
    assert report["heldout_mse"] < 0.5 * report["heldout_mse_random"], report
    assert report["heldout_episodes"] == [5] and report["steps"] == 8 and len(report["history"]) == 8
    assert report["frame_size"] == [32, 64] and report["clip_frames"] == 5
    assert json.loads((out / "report.json").read_text())["heldout_mse"] == report["heldout_mse"]
    with safe_open(str(out / "vae.safetensors"), "pt") as f:  # pickle-free, says what it is
        meta = f.metadata()
    assert meta["preset"] == "tiny" and meta["folded_normalisation"] == "true"
    assert len(json.loads(meta["latents_std"])) == 8


def test_the_file_loads_as_train_encoder_weights_vae_with_unit_scale_latents(data, pretrained):
    out, report = pretrained
    cfg = _cfg(data, encoder_weights={"vae": str(out / "vae.safetensors")})
    loaded, seeded = frozen_encoders(cfg), frozen_encoders(_cfg(data))
    train_sets, heldout_sets = vision_windows(cfg, 5, heldout_episodes=1)
    heldout = load_clips(heldout_sets, spread_items(heldout_sets, 6), 5)
    assert reconstruction_mse(loaded.vae, heldout) == pytest.approx(report["heldout_mse"], rel=1e-4)
    assert reconstruction_mse(seeded.vae, heldout) == pytest.approx(report["heldout_mse_random"], rel=1e-4)
    # only the VAE changed: the text and image encoders keep the seeded numbers of a run without the file
    for a, b in zip(loaded.text_encoder.parameters(), seeded.text_encoder.parameters()):
        assert torch.equal(a, b)
    clips = load_clips(train_sets, random_items(train_sets, 8, seed=5, first_position=10**6), 5)
    mean, std = latent_statistics(loaded.vae, clips)
    assert mean.abs().max() < 0.5 and 0.5 < std.min() and std.max() < 2.0, (mean, std)


def test_folding_the_latent_statistics_into_the_vae_is_exact():
    from dzmodel.model.components import build_encoders

    torch.manual_seed(0)
    vae = build_encoders("tiny").vae
    video = torch.rand(2, 3, 5, 32, 64) * 2 - 1
    with torch.no_grad():
        before = vae.encode(video)
        decoded = vae.decode(before)
        mu, log_var = vae.encode_moments(video)
    assert torch.equal(mu, before) and log_var.shape == before.shape
    mean, std = torch.randn(8).double(), torch.rand(8).double() + 0.5
    fold_latent_normalisation(vae, mean, std)
    with torch.no_grad():
        after = vae.encode(video)
        shape = (1, -1, 1, 1, 1)
        torch.testing.assert_close(after, (before - mean.float().view(shape)) / std.float().view(shape),
                                   rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(vae.decode(after), decoded, rtol=1e-4, atol=1e-4)


def test_settings_it_cannot_honour_are_refused(data, tmp_path):
    kw = dict(steps=1, batch_size=1, lr=1e-3, device="cpu", progress=False)
    with pytest.raises(VisionError, match="offline presets"):
        pretrain_vae(_cfg(data, preset="dreamzero_5b"), tmp_path, clip_frames=5, **kw)
    with pytest.raises(VisionError, match="encoder_weights.vae is set"):
        pretrain_vae(_cfg(data, encoder_weights={"vae": "wan.safetensors"}), tmp_path, clip_frames=5, **kw)
    with pytest.raises(VisionError, match="1 \\+ 4k"):
        pretrain_vae(_cfg(data), tmp_path, clip_frames=4, **kw)
    with pytest.raises(VisionError, match="exceeds the SFT windows' 17 frames"):
        pretrain_vae(_cfg(data), tmp_path, clip_frames=21, **kw)
    assert not (tmp_path / "vae.safetensors").exists()


# --- the pipeline's vision stage ------------------------------------------------------------------------------------

def _profile(root: Path, *overrides):
    (root / "emb.yaml").write_text(LIBERO32_EMBODIMENT)
    params = load_params(ROOT / "params.yaml", [
        "fetch.synth_episodes=3", "fetch.synth_length=40", "fetch.synth_motion=orbit",
        "metadata.embodiment=libero_sim_32", "metadata.embodiment_files=[emb.yaml]", *overrides], "demo")
    return params.selected(), StagePaths(root, "demo")


def test_the_vision_stage_feeds_its_vae_to_cache_and_train(tmp_path):
    from dzmodel.pipeline import outputs_intact, run_stage

    quiet = dict(log=lambda line: None)
    prof, paths = _profile(tmp_path, "vision.enabled=true", "vision.steps=2", "vision.batch_size=2",
                           "vision.clip_frames=1", "vision.device=cpu")
    with pytest.raises(FileNotFoundError, match="run the vision stage"):
        run_stage("cache", prof, paths, **quiet)
    run_stage("fetch", prof, paths, **quiet)
    run_stage("metadata", prof, paths, **quiet)
    result = run_stage("vision", prof, paths, **quiet)
    assert result["vae"] == str(paths.vision_vae) and paths.vision_vae.is_file() and outputs_intact("vision", paths)
    assert json.loads(paths.metrics("vision").read_text())["pretrained"] is True
    cfg = train_config(prof, paths)
    assert cfg.encoder_weights == {"vae": str(paths.vision_vae)}
    assert train_config(prof, paths, vision_vae=False).encoder_weights == {}
    frozen_encoders(cfg)  # loads strictly

    off, _ = _profile(tmp_path)
    assert run_stage("vision", off, paths, **quiet)["vision"] is None
    assert (paths.stage("vision") / "DISABLED").is_file() and not paths.vision_vae.exists()
    assert train_config(off, paths).encoder_weights == {}
    assert json.loads(paths.metrics("vision").read_text()) == {"pretrained": False}


def test_params_refuse_vision_where_it_cannot_run():
    with pytest.raises(ParamsError, match="libero_5b: vision.enabled: train.encoder_weights.vae is set"):
        load_params(ROOT / "params.yaml", ["vision.enabled=true"], "libero_5b")
    with pytest.raises(ParamsError, match="vision.clip_frames must be 1 \\+ 4k"):
        load_params(ROOT / "params.yaml", ["vision.clip_frames=4"], "demo")
    raw = read_yaml(ROOT / "params.yaml")
    parse_params(raw)
    bad = copy.deepcopy(raw)
    del bad["profiles"]["demo"]["vision"]
    with pytest.raises(ParamsError, match="profiles.demo.vision: missing \\(dvc.yaml's vision stage"):
        parse_params(bad)


def test_device_clips_equal_the_loader_clips_without_augmentation(data):
    """`vision.data_on_device` gathers the same frames as the loader path (held-out windows: no augmentation)."""
    from dzmodel.train.vision import device_clips

    cfg = _cfg(data)
    _, heldout = vision_windows(cfg, 5, 1)
    items = spread_items(heldout, 5)
    expected = load_clips(heldout, items, 5)
    got = torch.cat(list(device_clips(cfg, heldout, items, 2, 5, torch.device("cpu"), log=lambda line: None)))
    assert got.dtype == torch.uint8 and got.shape == expected.shape
    assert torch.equal(got, expected)


def test_vision_pretraining_on_device_data_learns(data, tmp_path):
    lines = []
    report = pretrain_vae(_cfg(data), tmp_path / "v", steps=8, batch_size=2, lr=3e-3, clip_frames=5,
                          heldout_episodes=1, device="cpu", eval_clips=6, norm_clips=8, data_on_device=True,
                          progress=False, log=lines.append)
    assert any("episode videos decoded to" in line for line in lines), lines
    assert report["heldout_mse"] < 0.5 * report["heldout_mse_random"], report


def test_the_vae_loss_is_one_graphable_call_with_the_noise_given():
    """`VAELoss` (what each vision step runs, and what CUDA graphs capture): MSE + kl_weight · KL of the posterior
    sampled with the given noise, gradients into the VAE, no noise drawn inside; the latent statistics come from a
    per-device cache (a graph cannot copy them from the host while capturing)."""
    from dzmodel.model.conditioning import video_to_unit_range
    from dzmodel.train.vision import VAELoss

    vae = frozen_encoders(TrainConfig(preset="tiny", datasets=[]), "cpu").vae.float().requires_grad_(True)
    video = video_to_unit_range(torch.randint(0, 256, (2, 5, 32, 64, 3), dtype=torch.uint8))
    loss_fn = VAELoss(vae, kl_weight=0.5)
    eps = torch.randn(loss_fn.latent_shape(video))
    loss, mse, kl = loss_fn(video, eps)
    mu, log_var = vae.encode_moments(video)
    log_var = log_var.clamp(-30.0, 20.0)
    recon = vae.decode(mu + (0.5 * log_var).exp() * eps)
    want_mse = torch.nn.functional.mse_loss(recon, video)
    want_kl = 0.5 * (mu.pow(2) + log_var.exp() - 1 - log_var).mean()
    torch.testing.assert_close(mse, want_mse.detach())
    torch.testing.assert_close(loss, want_mse + 0.5 * want_kl)
    assert not mse.requires_grad and not kl.requires_grad and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None for p in vae.parameters())
    assert not torch.equal(loss_fn(video, torch.zeros_like(eps))[1], mse)  # the noise given is the noise used
    assert VAELoss(vae, 0.0)(video, eps)[1] == VAELoss(vae, 0.0)(video, torch.zeros_like(eps))[1]  # kl 0: mu
    assert vae._stats(mu)[0] is vae._stats(mu)[0]
