"""The WAN video VAEs: checkpoint layout, reference parity, causality, batching, input checks."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dzmodel.model.manifest import compare_to_manifest
from dzmodel.model.state_dict import StateDictError
from dzmodel.model.vae import (
    WAN21_LATENTS_MEAN,
    WAN21_LATENTS_STD,
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    WanVAE38Config,
    WanVAEConfig,
    WanVideoVAE,
    WanVideoVAE38,
    run_vae_fixture,
)

FIXTURE = "wan22_vae_tiny_reference.safetensors"
TOL = 1e-4


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1) random weights so every path (incl. the zero-initialised attention proj) matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() > 1:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def tiny21() -> WanVideoVAE:
    cfg = WanVAEConfig(dim=8, z_dim=4, latents_mean=(0.1, -0.2, 0.3, 0.0), latents_std=(1.5, 0.5, 2.0, 1.0))
    return randomize_(WanVideoVAE(cfg), seed=1).eval()


def tiny22() -> WanVideoVAE38:
    cfg = WanVAE38Config(dim=8, dec_dim=12, z_dim=8, latents_mean=(0.2,), latents_std=(0.7,))
    return randomize_(WanVideoVAE38(cfg), seed=2).eval()


def video(batch=1, frames=9, h=32, w=32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, 3, frames, h, w, generator=g) * 2 - 1


def max_err(a, b) -> float:
    return (a - b).abs().max().item()


# --- checkpoint layout -----------------------------------------------------------------


@pytest.mark.parametrize("cls, entry", [(WanVideoVAE, "wan2.1_vae"), (WanVideoVAE38, "wan2.2_vae")])
def test_full_size_vae_matches_checkpoint_manifest(cls, entry):
    with torch.device("meta"):
        vae = cls()
    diff = compare_to_manifest(vae, entry)
    assert diff.ok, diff.summary()


def test_presets_hold_published_latent_statistics():
    assert WanVAEConfig().latents_mean == WAN21_LATENTS_MEAN and len(WAN21_LATENTS_MEAN) == 16
    assert WanVAEConfig().latents_std == WAN21_LATENTS_STD and len(WAN21_LATENTS_STD) == 16
    assert WanVAE38Config().latents_mean == WAN22_LATENTS_MEAN and len(WAN22_LATENTS_MEAN) == 48
    assert WanVAE38Config().latents_std == WAN22_LATENTS_STD and len(WAN22_LATENTS_STD) == 48
    assert WAN21_LATENTS_MEAN[7] == 1.5508 and WAN21_LATENTS_STD[8] == 3.2687
    assert WAN22_LATENTS_MEAN[19] == 0.5109 and WAN22_LATENTS_STD[39] == 1.6887
    assert WanVAE38Config().dim == 160 and WanVAE38Config().dec_dim == 256 and WanVAEConfig().dim == 96
    assert WanVAEConfig().spatial_factor == 8 and WanVAE38Config().spatial_factor == 16


# --- reference parity --------------------------------------------------------------------


@pytest.fixture(scope="module")
def vae_fixture(fixtures_dir):
    path = fixtures_dir / FIXTURE
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    return load_file(str(path)), metadata


def test_fixture_parity(vae_fixture):
    tensors, metadata = vae_fixture
    out = run_vae_fixture(tensors, metadata)
    assert set(out) == {"latent_mu", "decoded"}
    for name in out:
        ref = tensors[f"output.{name}"]
        assert out[name].shape == ref.shape
        assert out[name].dtype == torch.float32
        assert max_err(out[name], ref) <= TOL, f"{name}: max abs err {max_err(out[name], ref):.3e}"


def test_config_from_fixture_metadata(vae_fixture):
    _, metadata = vae_fixture
    cfg = WanVAE38Config.from_metadata(metadata)
    assert cfg.dim == int(metadata["dim"]) and cfg.dec_dim == int(metadata["dec_dim"])
    assert cfg.z_dim == int(metadata["z_dim"]) and cfg.num_res_blocks == int(metadata["num_res_blocks"])
    assert cfg.dim_mult == tuple(int(v) for v in metadata["dim_mult"].split(","))
    assert cfg.temperal_downsample == tuple(v.strip() == "True" for v in metadata["temperal_downsample"].split(","))
    mean, std = (float(v) for v in metadata["scale"].split(","))
    assert cfg.latents_mean == (mean,) and cfg.latents_std == (std,)
    per_channel = WanVAE38Config.from_metadata({"z_dim": "2", "scale": "0.5,-0.5,2,4"})
    assert per_channel.latents_mean == (0.5, -0.5) and per_channel.latents_std == (2.0, 4.0)
    with pytest.raises(ValueError, match="dim_mult"):
        WanVAE38Config.from_metadata({"dim_mult": "1,two,4"})
    with pytest.raises(ValueError, match="temperal_downsample"):
        WanVAEConfig.from_metadata({"temperal_downsample": "True,True,True"})


def test_fixture_loading_is_strict(vae_fixture):
    tensors, metadata = vae_fixture
    broken = dict(tensors)
    del broken["weights.decoder.head.2.weight"]
    broken["weights.encoder.extra.weight"] = torch.zeros(1)
    with pytest.raises(StateDictError) as info:
        run_vae_fixture(broken, metadata)
    assert "decoder.head.2.weight" in str(info.value) and "encoder.extra.weight" in str(info.value)


# --- streaming / causality -------------------------------------------------------------


@pytest.mark.parametrize("make", [tiny21, tiny22], ids=["wan2.1", "wan2.2"])
def test_encode_is_causal(make):
    vae = make()
    x = video(frames=9)
    later_changed = x.clone()
    later_changed[:, :, 5:] = video(frames=4, seed=7)
    with torch.no_grad():
        full = vae.encode(x)
        prefix = vae.encode(x[:, :, :5])
        changed = vae.encode(later_changed)
    assert full.shape[2] == 3 and prefix.shape[2] == 2
    assert max_err(prefix, full[:, :, :2]) <= 1e-5
    assert max_err(changed[:, :, :2], full[:, :, :2]) <= 1e-5
    assert max_err(changed[:, :, 2], full[:, :, 2]) > 1e-3  # the last latent does see frames 5..8


@pytest.mark.parametrize("make", [tiny21, tiny22], ids=["wan2.1", "wan2.2"])
def test_streamed_encode_of_new_frames_equals_the_whole_video(make):
    """A session encodes frame 0, then only each new 4-frame chunk (its StreamState holds the history), and gets
    the latents of encoding everything at once; one sample's state can be taken out of a batch."""
    from dzmodel.model.vae import StreamState

    vae = make()
    x = torch.cat([video(frames=9, seed=20), video(frames=9, seed=21)])
    with torch.no_grad():
        whole = vae.encode(x)
        state = StreamState()
        parts = [vae.encode(x[:, :, :1], state)]
        one = state.select(1)
        parts += [vae.encode(x[:, :, 1:5], state), vae.encode(x[:, :, 5:9], state)]
        alone = vae.encode(x[1:, :, 1:9], one)
        with pytest.raises(ValueError, match="4k frames"):
            vae.encode(x[:, :, :3], state)
    assert max_err(torch.cat(parts, dim=2), whole) <= 1e-5
    assert max_err(alone, whole[1:, :, 1:]) <= 1e-5


@pytest.mark.parametrize("make", [tiny21, tiny22], ids=["wan2.1", "wan2.2"])
def test_decode_is_causal(make):
    vae = make()
    g = torch.Generator().manual_seed(3)
    z = torch.randn(1, vae.config.z_dim, 3, 2, 2, generator=g)
    with torch.no_grad():
        full = vae.decode(z)
        prefix = vae.decode(z[:, :, :2])
    assert prefix.shape[2] == 5 and full.shape[2] == 9
    assert max_err(prefix, full[:, :, :5]) <= 1e-5


@pytest.mark.parametrize("make", [tiny21, tiny22], ids=["wan2.1", "wan2.2"])
def test_batch_equals_single_samples(make):
    vae = make()
    x = torch.cat([video(seed=10), video(seed=11)])
    with torch.no_grad():
        both = vae.encode(x)
        singles = torch.cat([vae.encode(x[:1]), vae.encode(x[1:])])
        decoded = vae.decode(both)
        decoded_singles = torch.cat([vae.decode(both[:1]), vae.decode(both[1:])])
    assert max_err(both[0], both[1]) > 1e-3  # the two samples really differ
    assert max_err(both, singles) <= 1e-5
    assert max_err(decoded, decoded_singles) <= 1e-5


def test_wan21_round_trip_shapes():
    vae = tiny21()
    x = video(batch=2, frames=9, h=32, w=48)
    with torch.no_grad():
        z = vae.encode(x)
        y = vae.decode(z)
        image = vae.encode(x[:, :, :1])
        clamped = vae.decode(z, clamp=True)
    assert z.shape == (2, 4, 3, 4, 6)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert image.shape == (2, 4, 1, 4, 6)
    assert max_err(image, z[:, :, :1]) <= 1e-5
    assert clamped.min() >= -1 and clamped.max() <= 1 and max_err(clamped, y.clamp(-1, 1)) == 0


def test_wan22_shapes_and_normalisation():
    vae = tiny22()
    x = video(frames=5, h=32, w=64)
    with torch.no_grad():
        z = vae.encode(x)
        y = vae.decode(z)
    assert z.shape == (1, 8, 2, 2, 4) and y.shape == x.shape
    raw = torch.randn(1, 8, 2, 2, 2)
    normed = vae.normalize_latents(raw)
    assert max_err(normed, (raw - 0.2) / 0.7) <= 1e-6
    assert max_err(vae.denormalize_latents(normed), raw) <= 1e-6


def test_wan22_patchify_round_trip():
    vae = tiny22()
    x = torch.randn(2, 3, 5, 8, 12)
    p = vae._patchify(x)
    assert p.shape == (2, 12, 5, 4, 6)
    # channel (c, dw, dh): channel 1 of colour 0 is the pixel one step down (dh = 1).
    assert torch.equal(p[:, 1], x[:, 0, :, 1::2, 0::2])
    assert torch.equal(p[:, 2], x[:, 0, :, 0::2, 1::2])
    assert torch.equal(vae._unpatchify(p), x)


# --- input checks -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [tiny21, tiny22], ids=["wan2.1", "wan2.2"])
def test_bad_inputs_raise_clear_errors(make):
    vae = make()
    with pytest.raises(ValueError, match="1 \\+ 4k frames.*got 8"):
        vae.encode(video(frames=8))
    with pytest.raises(ValueError, match="3 \\(RGB\\) channels.*got 4"):
        vae.encode(torch.zeros(1, 4, 5, 32, 32))
    with pytest.raises(ValueError, match="rank 5.*got rank 4"):
        vae.encode(torch.zeros(3, 5, 32, 32))
    with pytest.raises(ValueError, match=f"multiples of {vae.config.spatial_factor}"):
        vae.encode(torch.zeros(1, 3, 5, 32, 36))
    with pytest.raises(ValueError, match="float"):
        vae.encode(torch.zeros(1, 3, 5, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"z_dim={vae.config.z_dim} channels"):
        vae.decode(torch.zeros(1, vae.config.z_dim + 1, 2, 2, 2))
    with pytest.raises(ValueError, match="rank 5"):
        vae.decode(torch.zeros(vae.config.z_dim, 2, 2, 2))


def test_bad_configs_raise():
    with pytest.raises(ValueError, match="latents_mean"):
        WanVAEConfig(z_dim=4, latents_mean=(0.0, 1.0), latents_std=(1.0,))
    with pytest.raises(ValueError, match="temperal_downsample"):
        WanVAEConfig(temperal_downsample=(True, True))
    with pytest.raises(ValueError, match="WanVAE38Config"):
        WanVideoVAE38(WanVAEConfig())
    with pytest.raises(ValueError, match="WanVAEConfig"):
        WanVideoVAE(WanVAE38Config())
