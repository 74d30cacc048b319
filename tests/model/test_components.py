"""Frozen encoders per preset, WAN component-file loading, batched conditioning."""

import torch
from safetensors.torch import save_file

from dzmodel.model.args import preset
from dzmodel.model.components import build_encoders, load_encoder_weights
from dzmodel.model.conditioning import encode_batch
from dzmodel.model.t5 import zero_beyond_lengths


def _counting(vae):
    calls = []
    orig = vae.encode

    def encode(video):
        calls.append(tuple(video.shape))
        return orig(video)

    vae.encode = encode
    return calls


def _batch(B=2, T=5):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 255, (B, T, 64, 64, 3), generator=g, dtype=torch.uint8)
    ids = torch.randint(3, 600, (B, 16), generator=g)
    mask = torch.zeros(B, 16, dtype=torch.long)
    mask[0, :11] = 1
    mask[1, :5] = 1
    return images, ids, mask


def test_5b_style_model_encodes_the_video_once_and_skips_y():
    enc = build_encoders("tiny")
    calls = _counting(enc.vae)
    images, ids, mask = _batch()
    out = encode_batch(preset("tiny"), enc.vae, enc.text_encoder, enc.image_encoder, images, ids, mask)
    assert len(calls) == 1 and calls[0][0] == 2  # one batched call for the whole micro-batch
    assert out.y is None
    assert out.clean_latents.shape == (2, 8, 2, 4, 4)
    assert out.clip_feature.shape == (2, 17, 64)


def test_14b_style_model_adds_the_first_frame_condition():
    enc = build_encoders("tiny")
    calls = _counting(enc.vae)
    images, ids, mask = _batch()
    args = preset("tiny", in_dim=8 + 20, concat_first_frame_latent=True)
    out = encode_batch(args, enc.vae, enc.text_encoder, enc.image_encoder, images, ids, mask)
    assert len(calls) == 2
    assert out.y.shape == (2, 4 + 8, 2, 4, 4)
    assert (out.y[:, :4, 0] == 1).all() and (out.y[:, :4, 1:] == 0).all()


def test_text_is_zeroed_per_sample_not_to_the_shortest_prompt():
    enc = build_encoders("tiny")
    images, ids, mask = _batch()
    out = encode_batch(preset("tiny"), enc.vae, enc.text_encoder, enc.image_encoder, images, ids, mask)
    assert out.context[0, :11].abs().sum() > 0  # upstream's bug would zero sample 0 beyond 5 tokens
    assert (out.context[0, 11:] == 0).all() and (out.context[1, 5:] == 0).all()
    single = zero_beyond_lengths(enc.text_encoder(ids[:1], mask[:1]), mask[:1])
    torch.testing.assert_close(out.context[:1], single)


def test_wan_component_files_load_strictly(tmp_path):
    src = build_encoders("tiny")
    save_file(src.vae.state_dict(), str(tmp_path / "vae.safetensors"))
    torch.save(src.text_encoder.state_dict(), str(tmp_path / "t5.pth"))
    clip_state = dict(src.image_encoder.state_dict())
    clip_state["textual.token_embedding.weight"] = torch.zeros(3, 3)  # the full WAN CLIP file has a text tower
    clip_state["log_scale"] = torch.zeros(())
    torch.save(clip_state, str(tmp_path / "clip.pth"))
    dst = build_encoders("tiny", device="meta")
    reports = load_encoder_weights(dst, vae=tmp_path / "vae.safetensors", t5=tmp_path / "t5.pth", clip=tmp_path / "clip.pth")
    assert [r.missing for r in reports] == [[], [], []]
    torch.testing.assert_close(dst.text_encoder.token_embedding.weight, src.text_encoder.token_embedding.weight)
    torch.testing.assert_close(dst.image_encoder.visual.patch_embedding.weight, src.image_encoder.visual.patch_embedding.weight)
